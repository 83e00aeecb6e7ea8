"""docs/architecture.md's "One training step" is the trace of a steady step (issue #43 item 6, STYLE.md habit 13).

One group of 2 gloo ranks traces a steady step of each strategy (plain DDP, ZeRO-1, ZeRO-2, the overlapped step;
``step_trace.py`` says how) and the page must list exactly the lockstep functions each runs, each under the phase
that first enters it, and state the counts the trace gives (functions, files, file switches in the backward).
When the code changes, ``python tests/step_trace.py --write`` rewrites the blocks and the counts; then read the
prose around them again: it explains the lists, and no test reads it.
"""

from __future__ import annotations

import sys
import time

import pytest
import step_trace as st

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the trace names functions by their code's "
                                "co_qualname, which Python 3.11 added")

PAGE = st.DOC.read_text()
BLOCKS = st.page_blocks(PAGE)
COUNTS = st.page_counts(PAGE)
REWRITE = "(python tests/step_trace.py --write rewrites the page's blocks and counts from the trace)"


@pytest.fixture(scope="module")
def traced() -> list[dict[str, list[st.Trace]]]:
    start = time.monotonic()
    ranks = st.trace_all()
    print(f"\ntraced {st.TRACED_STEPS} steady steps of {len(st.STRATEGIES)} strategies on 2 ranks in "
          f"{time.monotonic() - start:.1f} s")
    return ranks


def samples(traced, name: str) -> list[tuple[str, st.Trace]]:
    return [(f"rank {r} step {i + 1}", t) for r, rank in enumerate(traced) for i, t in enumerate(rank[name])]


def test_page_has_a_block_and_a_row_per_strategy():
    assert sorted(BLOCKS) == sorted(st.STRATEGIES), f"docs/architecture.md's step-trace blocks: {sorted(BLOCKS)}"
    assert sorted(COUNTS) == sorted(st.STRATEGIES), f"docs/architecture.md's counts table rows: {sorted(COUNTS)}"
    for name, block in BLOCKS.items():
        listed = st.parse_block(block)
        assert all(phase in st.PHASES for phase, _, _ in listed), f"{name}: a phase not one of {st.PHASES}"
        pairs = [(file, function) for _, file, function in listed]
        assert len(pairs) == len(set(pairs)), f"{name}: a function listed twice"


@pytest.mark.parametrize("name", st.STRATEGIES)
def test_the_traced_step_is_steady(traced, name):
    # Both traced steps on both ranks run the same functions in the same phases: the warm-up was long enough, and
    # the page's list does not depend on which rank or step was traced (the order inside a phase may: ZeRO-2's
    # reaping depends on when its reductions finish).
    phases = {where: {(c.file, c.function): c.phase for c in t.distinct()} for where, t in samples(traced, name)}
    first, *rest = phases.items()
    for where, got in rest:
        assert got == first[1], f"{name}: {where} differs from {first[0]}: {set(got.items()) ^ set(first[1].items())}"
    assert all(t.calls for _, t in samples(traced, name))


@pytest.mark.parametrize("name", st.STRATEGIES)
def test_page_lists_what_runs(traced, name):
    listed = {(file, function): phase for phase, file, function in st.parse_block(BLOCKS[name])}
    for where, trace in samples(traced, name):
        ran = {(c.file, c.function): c.phase for c in trace.distinct()}
        lacks = sorted(f"{f}:{fn}  ({ran[f, fn]})" for f, fn in ran.keys() - listed.keys())
        excess = sorted(f"{f}:{fn}  ({listed[f, fn]})" for f, fn in listed.keys() - ran.keys())
        assert not lacks and not excess, (
            f"docs/architecture.md's {name} block differs from the traced step ({where}) {REWRITE}\n"
            + "".join(f"  the page lacks   {line}\n" for line in lacks)
            + "".join(f"  the page lists   {line}, which the step never entered\n" for line in excess))
        moved = sorted(f"{f}:{fn}: the page says {listed[f, fn]}, first entered in {phase}"
                       for (f, fn), phase in ran.items() if listed[f, fn] != phase)
        assert not moved, f"docs/architecture.md's {name} block, phases ({where}) {REWRITE}\n  " + "\n  ".join(moved)


@pytest.mark.parametrize("name", st.STRATEGIES)
def test_page_states_the_counts(traced, name):
    stated = COUNTS[name]
    listed = st.parse_block(BLOCKS[name])
    assert (stated.functions, stated.files) == (len(listed), len({file for _, file, _ in listed})), (
        f"{name}: the table's functions and files are not its block's {REWRITE}")
    low, high = stated.switches
    for where, trace in samples(traced, name):
        functions, files, switches = trace.counts()
        assert (functions, files) == (stated.functions, stated.files), (
            f"{name} ({where}): {functions} functions in {files} files; the page says {stated.functions} in "
            f"{stated.files} {REWRITE}")
        assert low <= switches <= high, (
            f"{name} ({where}): {switches} file switches in the backward; the page says {stated.cell()} {REWRITE}")


def test_tracer_phases_and_switches():
    # The tracer's own rules on a hand-made step: the entry called most often in the backward is the hook.
    rec = st._Recorder("/x/lockstep")
    for call in [("backward", "ddp/graph.py", "start", 0, False), ("backward", "ddp/reducer.py", "hook", 1, False),
                 ("backward", "ddp/reducer.py", "hook", 2, False), ("backward", "ddp/reducer.py", "full", 2, True),
                 ("backward", "ddp/schedule.py", "issue", 2, True), ("backward", "ddp/reducer.py", "end", 3, False)]:
        rec.raw.append(call)
    rec.entry_functions = ["start", "hook", "hook", "end"]
    trace = rec.trace()
    assert [c.phase for c in trace.calls] == ["backward start", "per gradient", "per gradient", "bucket full",
                                              "bucket full", "end of backward"]
    assert trace.backward_switches() == 3  # graph -> reducer, reducer -> schedule -> reducer
    assert st.block_text(trace).splitlines()[:3] == ["# backward start", "ddp/graph.py:start", "# per gradient"]
    assert st.parse_block(st.block_text(trace))[0] == ("backward start", "ddp/graph.py", "start")
    assert st.page_counts("| ZeRO-2 | `zero2` | 102 | 20 | 105-109 |")["zero2"] == st.Counts(102, 20, (105, 109))
