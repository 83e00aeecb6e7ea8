"""Trace one steady training step of each strategy: the lockstep functions it enters, in order, by phase.

docs/architecture.md's "One training step" is this trace (STYLE.md habit 13): per strategy, the files and
functions a steady step passes through, each listed once under the phase that first enters it, and three counts
(functions, files, file switches in the backward). ``tests/test_step_trace.py`` traces the same steps and fails
where the page differs. Run this file to print the blocks as the page shows them, or to write them into the page:

    python tests/step_trace.py            # print each strategy's block and counts
    python tests/step_trace.py --write    # replace the marked blocks and the counts table in docs/architecture.md

How it traces. 2 real gloo ranks (``dist_utils.run_ranks``) build the same MLP (4 Linear layers, 8 tensors) under
``lockstep.DistributedDataParallel(bucket_cap_mb_list=[0.1])`` (3 buckets, whatever the machine: the default caps
pick the first bucket's size by the cores free, and go to trials of other caps where the wire is slow), run
``WARMUP_STEPS`` steps (buckets rebuilt, the link measured, the overlapped step's sequence agreed), then trace
``TRACED_STEPS`` steps with ``sys.setprofile``: forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``.
A call is recorded when its frame's file is under ``src/lockstep/``; comprehensions and generator expressions are
folded into the function that runs them (Python 3.12 inlines comprehensions; a generator's every resumption is a
profiler "call"); lambdas and nested functions count. On CPU autograd runs every hook and the queued end of
backward on the thread that called ``backward()``, so the main thread's profile sees the whole step; other Python
threads started after the tracer (``threading.setprofile``: the hang watchdog's, which publishes a heartbeat once a
second) are recorded apart and left out of the lists (``Trace.other_threads``). A CUDA backward would run on
autograd's device thread, which this trace does not cover.

Phases. The driver names forward, backward, optimizer step and zero_grad. Inside the backward, each call belongs to
an entry (the outermost lockstep frame on its stack, called by torch's autograd): the entry function called most
often is the per-gradient hook; calls under entries before its first call are "backward start", after its last
"end of backward" (the callback queued with autograd's ``queue_callback``), in between "per gradient", except those
under ``BUCKET_FULL`` (the function a gradient's hook calls when its bucket is complete), which are "bucket full".
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
STRATEGIES = ("plain", "zero1", "zero2", "overlap")
PHASES = ("forward", "backward start", "per gradient", "bucket full", "end of backward", "optimizer step",
          "zero_grad")
BUCKET_FULL = frozenset({"Reducer.bucket_full"})  # rename here when the reducer renames it
FOLDED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
WARMUP_STEPS = 5
TRACED_STEPS = 2  # the second shows the first was steady (the same functions in the same phases)


@dataclasses.dataclass(frozen=True)
class Call:
    phase: str  # one of PHASES
    file: str  # relative to src/lockstep, e.g. "ddp/reducer.py"
    function: str  # the code object's qualified name, e.g. "Reducer.bucket_full", "make_hook.<locals>.hook"


@dataclasses.dataclass
class Trace:
    """One rank's traced step: every lockstep call in order (comprehensions folded)."""

    calls: list[Call]
    other_threads: dict[str, int]  # thread name -> lockstep calls it made while the step was traced
    threads: list[str]  # the Python threads alive during the step (the main one first)

    def distinct(self) -> list[Call]:
        """Each (file, function) once, under the phase that first entered it, in the order first entered."""
        seen: set[tuple[str, str]] = set()
        out = []
        for call in self.calls:
            if (call.file, call.function) not in seen:
                seen.add((call.file, call.function))
                out.append(call)
        return out

    def functions(self) -> set[tuple[str, str]]:
        return {(c.file, c.function) for c in self.calls}

    def files(self) -> set[str]:
        return {c.file for c in self.calls}

    def backward_switches(self) -> int:
        """Consecutive lockstep calls in the backward whose files differ."""
        files = [c.file for c in self.calls if c.phase in BACKWARD]
        return sum(a != b for a, b in itertools.pairwise(files))

    def counts(self) -> tuple[int, int, int]:
        return len(self.functions()), len(self.files()), self.backward_switches()


BACKWARD = PHASES[1:5]


class _Recorder:
    """The profile function: records each call into lockstep's files with the driver's phase and its entry."""

    def __init__(self, package_dir: str):
        self.prefix = package_dir.rstrip(os.sep) + os.sep
        self.phase: str | None = None
        # (phase, file, function, entry index, under BUCKET_FULL); an entry is the outermost lockstep frame
        self.raw: list[tuple[str, str, str, int, bool]] = []
        self.entries: dict[int, int] = {}  # id(entry frame) -> entry index (ids of dead frames are overwritten)
        self.entry_functions: list[str] = []
        self.other_threads: collections.Counter[str] = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or self.phase is None:
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.prefix):
            return
        outermost, anchored = frame, False
        f = frame
        while f is not None:
            if f.f_code.co_filename.startswith(self.prefix):
                outermost = f
                anchored = anchored or f.f_code.co_qualname in BUCKET_FULL
            f = f.f_back
        if outermost is frame:  # an entry (a comprehension too: a generator resumed by torch's code)
            self.entries[id(frame)] = len(self.entry_functions)
            self.entry_functions.append(code.co_qualname)
        if code.co_name not in FOLDED:
            self.raw.append((self.phase, code.co_filename[len(self.prefix):], code.co_qualname,
                             self.entries[id(outermost)], anchored))

    def thread_call(self, frame: Any) -> None:
        if self.phase is not None and frame.f_code.co_filename.startswith(self.prefix):
            self.other_threads[threading.current_thread().name] += 1

    def trace(self) -> Trace:
        """The raw calls with the backward split into its phases (the module docstring says how)."""
        backward_entries = [e for phase, *_, e, _ in self.raw if phase == "backward"]
        hook = collections.Counter(self.entry_functions[e] for e in set(backward_entries)).most_common(1)
        hook_entries = [e for e in sorted(set(backward_entries)) if hook and self.entry_functions[e] == hook[0][0]]
        if hook_entries and not any(anchored for *_, anchored in self.raw):
            raise RuntimeError(f"no call under {sorted(BUCKET_FULL)} in a backward that ran its hooks: name the "
                               "function a hook calls when its bucket is complete in step_trace.BUCKET_FULL")
        calls = []
        for phase, file, function, entry, anchored in self.raw:
            if phase == "backward":
                if not hook_entries or entry < hook_entries[0]:
                    phase = "backward start"
                elif entry > hook_entries[-1]:
                    phase = "end of backward"
                else:
                    phase = "bucket full" if anchored else "per gradient"
            calls.append(Call(phase, file, function))
        return Trace(calls, dict(self.other_threads), [t.name for t in threading.enumerate()])


_TRACING: list[_Recorder] = []  # the recorder of the step being traced, for the threads' profile function


def _thread_profile(frame: Any, event: str, arg: Any) -> None:
    # Set once per thread (threading.setprofile before the DDP starts its threads): it reports to whichever
    # strategy's recorder is tracing now.
    if event == "call" and _TRACING:
        _TRACING[-1].thread_call(frame)


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


def _strategy(name: str, ddp: Any) -> Any:
    """The optimizer a script steps, bound to ``ddp`` as each strategy's tests do."""
    import torch

    import lockstep

    if name == "zero2":  # tests/test_zero2.py
        return ddp.zero_optimizer(torch.optim.AdamW, stage=2, lr=1e-3)
    if name == "zero1":  # tests/test_zero.py: torch's ZeroRedundancyOptimizer API over the plain DDP
        return lockstep.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    if name == "overlap":  # tests/test_overlap_step.py
        opt = ddp.overlap_optimizer_step(opt)
    elif name != "plain":
        raise ValueError(f"strategy {name!r}, not one of {STRATEGIES}")
    return opt


def trace_strategy(name: str, rank: int, steps: int = TRACED_STEPS) -> list[Trace]:
    """On a rank of an initialised group: warm up, then trace ``steps`` steady steps of ``name``."""
    if sys.version_info < (3, 11):
        raise RuntimeError("step_trace names functions by code.co_qualname: Python 3.11 or later")
    import torch
    import torch.nn.functional as F

    import lockstep

    recorder = _Recorder(os.path.dirname(lockstep.__file__))
    threading.setprofile(_thread_profile)  # threads started from here on (the DDP's hang watchdog)
    try:
        ddp = lockstep.DistributedDataParallel(_model(), bucket_cap_mb_list=[0.1])
        opt = _strategy(name, ddp)
    finally:
        threading.setprofile(None)
    generator = torch.Generator().manual_seed(rank)

    def step(phase: Callable[[str | None], None]) -> None:
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        phase("forward")
        loss = F.cross_entropy(ddp(x), y)
        phase("backward")
        loss.backward()
        phase("optimizer step")
        opt.step()
        phase("zero_grad")
        opt.zero_grad()
        phase(None)

    def untraced(phase: str | None) -> None:
        pass

    def traced(phase: str | None) -> None:
        recorder.phase = phase

    for _ in range(WARMUP_STEPS):
        step(untraced)
    traces = []
    for _ in range(steps):
        recorder.raw.clear()
        recorder.other_threads.clear()
        _TRACING.append(recorder)
        sys.setprofile(recorder)
        try:
            step(traced)
        finally:
            sys.setprofile(None)
            recorder.phase = None
            _TRACING.pop()
        traces.append(recorder.trace())
    if name == "overlap":
        ddp.finish_step()
    return traces


def _ranks(rank: int, world_size: int, names: tuple[str, ...], steps: int) -> dict[str, list[Trace]]:
    return {name: trace_strategy(name, rank, steps) for name in names}


def trace_all(names: tuple[str, ...] = STRATEGIES, steps: int = TRACED_STEPS) -> list[dict[str, list[Trace]]]:
    """One group of 2 gloo ranks tracing every strategy in turn: per rank, per strategy, the traced steps."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import run_ranks

    return run_ranks(_ranks, 2, args=(names, steps))


# ------------------------------------------------------------------------------------------- the page's form
BLOCK = re.compile(r"^<!-- step-trace: (\w+) -->\n```text\n(.*?)^```$", re.M | re.S)
# A row of the counts table: | strategy's name | `key` | functions | files | switches, N or LOW-HIGH |
COUNTS = re.compile(r"^\| ([^|]+) \| `(\w+)` \| (\d+) \| (\d+) \| (\d+)(?:-(\d+))? \|$", re.M)


@dataclasses.dataclass(frozen=True)
class Counts:
    functions: int
    files: int
    switches: tuple[int, int]  # the lowest and highest seen: ZeRO-2's depend on when its reductions finish

    def cell(self) -> str:
        low, high = self.switches
        return str(low) if low == high else f"{low}-{high}"


def counts_of(samples: list[Trace]) -> Counts:
    """The counts the page states for a strategy, from its traced steps on every rank."""
    functions = {len(t.functions()) for t in samples}
    files = {len(t.files()) for t in samples}
    assert len(functions) == len(files) == 1, f"the traced steps differ: {functions} functions, {files} files"
    switches = [t.backward_switches() for t in samples]
    return Counts(functions.pop(), files.pop(), (min(switches), max(switches)))


def block_text(trace: Trace) -> str:
    """A strategy's block: a ``# phase`` line, then ``file:function`` per line, each function under its phase."""
    lines: list[str] = []
    current = None
    for call in trace.distinct():
        if call.phase != current:
            lines.append(f"# {call.phase}")
            current = call.phase
        lines.append(f"{call.file}:{call.function}")
    return "\n".join(lines) + "\n"


def parse_block(text: str) -> list[tuple[str, str, str]]:
    """(phase, file, function) per listed line of a block."""
    out, phase = [], ""
    for line in text.splitlines():
        if line.startswith("# "):
            phase = line[2:]
        elif line.strip():
            file, _, function = line.partition(":")
            out.append((phase, file, function))
    return out


def page_blocks(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in BLOCK.finditer(text)}


def page_counts(text: str) -> dict[str, Counts]:
    return {m.group(2): Counts(int(m.group(3)), int(m.group(4)), (int(m.group(5)), int(m.group(6) or m.group(5))))
            for m in COUNTS.finditer(text)}


def write_page(blocks: dict[str, str], counts: dict[str, Counts], path: Path = DOC) -> None:
    """Replace each strategy's marked block and its row of the counts table."""
    text = path.read_text()
    for name, block in blocks.items():
        marker = f"<!-- step-trace: {name} -->\n```text\n"
        text, n = re.subn(rf"^{re.escape(marker)}.*?^```$", (marker + block + "```").replace("\\", "\\\\"), text,
                          flags=re.M | re.S)
        assert n == 1, f"{path.name}: no <!-- step-trace: {name} --> block"
        c = counts[name]
        text, n = re.subn(rf"^(\| [^|]+ \| `{name}` \| ).*$", rf"\g<1>{c.functions} | {c.files} | {c.cell()} |", text,
                          flags=re.M)
        assert n == 1, f"{path.name}: no counts row for `{name}`"
    path.write_text(text)


def main(argv: list[str]) -> None:
    import time

    start = time.monotonic()
    steps = 20 if "--write" in argv else TRACED_STEPS  # the range of ZeRO-2's switches needs more steps
    ranks = trace_all(steps=steps)
    blocks, counts = {}, {}
    for name in STRATEGIES:
        first = ranks[0][name][0]
        blocks[name] = block_text(first)
        counts[name] = counts_of([t for rank in ranks for t in rank[name]])
        print(f"<!-- step-trace: {name} --> {counts[name]}; threads {first.threads}, their lockstep calls during "
              f"the step: {first.other_threads or 'none'}")
        print(blocks[name])
    if "--write" in argv:
        write_page(blocks, counts)
        print(f"wrote {DOC.relative_to(ROOT)}")
    print(f"traced {steps} steps a strategy on 2 ranks in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
