"""Two nodes over a rate-limited link: each DDP step against the limits the wire sets (issue #35), in one run.

Needs root, ``ip`` and ``tc`` (otherwise it says why and exits 0, a skip). ``tests/netns.py`` builds two
network namespaces joined by a veth pair; each end is shaped with a token bucket
(``tc qdisc replace dev VETH root tbf rate RATE burst 256kb latency 100ms``) at each of ``--rates``, and
``--ranks-per-node`` ranks (1 thread each, gloo over the veth) run in each namespace. Per rate and model,
every iteration times one step of each entry in a rotating order, each after a barrier, on rank 0:

    forward            the module's forward alone (autograd on)
    compute            forward + backward + SGD step, no DDP
    allreduce          one blocking all-reduce of a flat fp32 buffer of the gradients' bytes (checks the shaping)
    allreduce_fp16     the same numel in fp16: the fp16 rows' all-reduce (gloo sums fp16 on the CPU, so it takes
                       more than half the fp32 one)
    compute_wire       compute, timed while an all-reduce of the gradients' bytes runs beside it (started with the
                       forward, on a second gloo group: gloo's own thread): what the wire's CPU work (gloo's copies
                       and sums, the kernel's TCP, veth and shaper, on the same cores) leaves of the compute
    floor              compute, then that all-reduce, then the step: compute-then-send, nothing overlapped
    torch, torch_fp16  torch's DDP (25 MB buckets), and with its fp16_compress_hook
    torch_powersgd     torch's PowerSGD hook (rank 1) in one bucket: it issues collectives from future callbacks,
                       which gloo runs in a different order on each rank when there are several buckets (an abort)
    lockstep, lockstep_auto, lockstep_fp16, lockstep_powersgd
                       lockstep's DDP: default, bucket_cap_mb="auto", lockstep.comm_hooks' fp16 and PowerSGD hooks
                       (the default is hierarchical at 2 ranks per node: the ranks get GROUP_RANK and LOCAL_WORLD_SIZE
                       as torchrun sets them)
    lockstep_flat      lockstep's DDP with hierarchical_all_reduce=False: the flat ring over every rank
    lockstep_overlap   lockstep's DDP with model.overlap_optimizer_step(opt) (skipped, saying so, where it is missing)
    lockstep_zero2     lockstep's DDP with model.zero_optimizer(SGD, stage=2) through the all-reduce pair (two
                       all-reduces, 2 x DDP's bytes; gloo's default before the ring); lockstep_zero2_flat with
                       reduce_scatter / all_gather, 1.5 x DDP's bytes on gloo (its reduce-scatter sends what a whole
                       all-reduce sends); lockstep_zero2_ring with the ring's halves over send/recv (gloo's default
                       now: DDP's bytes); timed as lockstep_overlap

A DDP step can start sending only after its forward, so its limit is max(compute, forward + all-reduce)
(the *DDP limit*); where the wire's CPU work slows the compute (2 cores shared by both nodes, their gloo threads
and the kernel's network path), max(compute_wire, forward + all-reduce) (the *CPU limit*) is what a DDP can reach; a step that also overlapped the next forward with the wire could reach max(compute,
all-reduce) (the *wire limit*). Each contender is reported as a ratio to both and to torch's DDP with the
same hook; fp16 rows use limits with the measured fp16 all-reduce. PowerSGD rows use the fp32 limits (their wire
is a few hundred KB). Figures: median of per-block medians; ratios: median of per-block ratios [min-max],
paired in time so a shared machine's drift cancels. Below 500 Mbit/s the steps take seconds, so unless
``--blocks`` / ``--block-steps`` are given, those rates run 2 blocks of 2 (said in the output).

    python benchmarks/link.py [--rates 100mbit,1gbit,2.5gbit] [--models mlp,cnn,transformer]
                              [--contenders ...] [--ranks-per-node 1] [--trace DIR] [--out DIR]

``--trace DIR`` writes a Chrome trace (chrome://tracing, Perfetto) of one step per contender to
``DIR/<rate>/<model>/<contender>/trace.json``: lockstep's from its own recorder (``lockstep.diagnostics.trace``,
every rank; also summary.json and timeline.png), attached to the timed model for one extra step; torch's and
floor's on rank 0 from a fresh model whose comm hook wraps torch's (a Python hook instead of torch's built-in
C++ all-reduce) and records each bucket's issue and completion (its future's ``then``). With ``--trace`` each
contender also runs one more step with node 0's veth counter sampled every 0.5 ms (``wire_account.py``): the
results say how long the wire idled in that step and in which phase (forward, backward, optimizer step).

After the timing, each entry runs once more between two reads of node 0's veth counter (``tx_bytes``, rank 0):
the bytes node 0 sent over the link per step (TCP/IP headers included; the overlapped entries' call is
``STEPS_PER_CALL`` steps, divided out), reported beside the gradients' bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wire_account
from ddp_step import Transformer, _Floor, _step, _summarise, cnn
from torch import nn
from wire_account import WireSampler

REPO = Path(__file__).resolve().parents[1]
MEASURES = ("forward", "compute", "compute_wire", "allreduce", "allreduce_fp16")
CONTENDERS = ("floor", "torch", "torch_fp16", "torch_powersgd", "lockstep", "lockstep_flat", "lockstep_auto",
              "lockstep_fp16", "lockstep_powersgd", "lockstep_overlap", "lockstep_zero2", "lockstep_zero2_flat",
              "lockstep_zero2_ring")
# ZeRO-2 (issue #36): its parameters' all-gathers are waited for in the next forward, so it is timed as the
# overlapped step is (steady-state steps back to back); _flat forces gloo's reduce_scatter / all_gather pair, _ring
# the ring's halves over send/recv (gloo's default), the plain name the all-reduce pair (ddp/zero2_wire.py says
# why). Bytes a step, as a multiple of DDP's: the ring 1 (its halves are an all-reduce's); the all-reduce pair 2;
# the flat pair 1.5, not DDP's 1: gloo's reduce_scatter_tensor sends what a whole all-reduce sends, its all-gather
# half that (2 gloo ranks on loopback, torch 2.13: 2.00 and 1.00 x the buffer against the all-reduce's 2.01;
# benchmarks/results/link-2026-11-26-125333.md: 6.01 and 4.51 x over a three-step call)
ZERO2 = ("lockstep_zero2", "lockstep_zero2_flat", "lockstep_zero2_ring")
# Steps one call of an entry runs (_overlapped_steps: three); the others' call is one step
STEPS_PER_CALL = {"lockstep_overlap": 3, **dict.fromkeys(ZERO2, 3)}
POWERSGD_START = 2  # start_powerSGD_iter: torch's needs > 1 with error feedback; warm-up adds these steps
OVERLAP_PROBE_STEPS = 2  # overlap_optimizer_step measures the link over its first two rounds
ONE_BUCKET_MB = 1 << 20  # a cap no model here reaches
SLOW_RATE_BITS = 500e6
SLOW_SCHEDULE = (2, 2)  # (blocks, block steps) below SLOW_RATE_BITS unless the flags are given


def cap_of(name: str) -> float | None:
    """``lockstep_cap<MB>`` (lockstep's DDP with that fixed cap, for the auto-tuner's sweep): the cap, else None."""
    m = re.fullmatch(r"lockstep_cap([0-9]+(?:\.[0-9]+)?)", name)
    return float(m.group(1)) if m else None


def mlp_link() -> nn.Module:
    """The issue's MLP: 4 x Linear(1600, 1600) with ReLU and a Linear(1600, 10) head, 10.26M parameters, 41 MB."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(1600, 1600), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1600, 10))


# Batches picked so that one thread's compute is some tens of ms on a quiet core (the MLP's is the issue's).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]] = {
    "mlp": (mlp_link, lambda g: (torch.randn(128, 1600, generator=g), torch.randint(0, 10, (128,), generator=g))),
    "cnn": (cnn, lambda g: (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))),
    "transformer": (Transformer, lambda g: (torch.randint(0, 1000, (8, 32), generator=g),
                                            torch.randint(0, 10, (8,), generator=g))),
}


# ---------------------------------------------------------------------------------------------- pure parts
def rate_bits(text: str) -> float:
    """tc's rate syntax to bits per second: ``100mbit`` -> 1e8, ``2.5gbit`` -> 2.5e9 (SI prefixes, as tc's)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip().lower())
    if m is None:
        raise ValueError(f"rate {text!r} must look like 100mbit, 1gbit or 2.5gbit")
    return float(m.group(1)) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def torch_reference(name: str) -> str:
    """The torch contender a contender is compared with: the one with the same hook."""
    for hook in ("_fp16", "_powersgd"):
        if name.endswith(hook):
            return "torch" + hook
    return "torch"


def link_table(block_ms: dict[str, list[float]], nbytes: float | None = None, world_size: int = 2,
               chosen_mb: dict[str, float | None] | None = None) -> dict:
    """The limits and every contender's ratios, per block then summarised, from per-block medians in ms.

    ``block_ms`` holds ``forward``, ``compute``, ``allreduce`` and any contenders, each a list with one
    median per block. Per block: DDP limit = max(compute, forward + all-reduce), wire limit = max(compute,
    all-reduce), and the fp16 pair with the measured fp16 all-reduce (``allreduce_fp16``; half the fp32 one
    where absent). Each contender's ratios are taken block by block (paired in time) and given as median, min
    and max; ``torch`` is the ratio to the torch contender with the same hook, where it ran. ``nbytes`` (the
    gradients'): each contender's ``plan_ms`` too, with the cap in ``chosen_mb`` where a contender's trials chose
    one (None: one bucket), else its name's or 25 MB.
    """
    fwd, comp, ar = block_ms["forward"], block_ms["compute"], block_ms["allreduce"]
    # the fp16 rows' all-reduce: measured where it ran (gloo sums fp16 on the CPU, which halving the fp32 time
    # leaves out), else half the fp32 one
    ar16 = block_ms.get("allreduce_fp16") or [a / 2 for a in ar]
    limits = {
        "ddp": [max(c, f + a) for f, c, a in zip(fwd, comp, ar)],
        "wire": [max(c, a) for c, a in zip(comp, ar)],
        "ddp_fp16": [max(c, f + a) for f, c, a in zip(fwd, comp, ar16)],
        "wire_fp16": [max(c, a) for c, a in zip(comp, ar16)],
    }
    if "compute_wire" in block_ms:  # the compute as the wire's CPU work leaves it
        limits["cpu"] = [max(c, f + a) for f, c, a in zip(fwd, block_ms["compute_wire"], ar)]
    out: dict = {"measured_ms": {k: statistics.median(block_ms[k]) for k in MEASURES if k in block_ms},
                 "limits_ms": {k: statistics.median(v) for k, v in limits.items()}, "contenders": {}}
    for name in [n for n in CONTENDERS if n in block_ms] + sorted((n for n in block_ms if cap_of(n)), key=cap_of):
        blocks = block_ms[name]
        suffix = "_fp16" if name.endswith("_fp16") else ""
        row = {"ms": statistics.median(blocks), "limits": "fp16" if suffix else "fp32",
               "ddp_limit": _spread([t / lim for t, lim in zip(blocks, limits["ddp" + suffix])]),
               "wire_limit": _spread([t / lim for t, lim in zip(blocks, limits["wire" + suffix])])}
        if "cpu" in limits and not suffix:
            row["cpu_limit"] = _spread([t / lim for t, lim in zip(blocks, limits["cpu"])])
        ref = torch_reference(name)
        if ref in block_ms:
            row["torch"] = _spread([t / r for t, r in zip(blocks, block_ms[ref])])
            row["torch_ref"] = ref
        if nbytes is not None:
            chosen = (chosen_mb or {}).get(name, 0.0)
            cap = None if chosen == 0.0 else (ONE_BUCKET_MB if chosen is None else chosen)
            row["plan_ms"] = plan_ms(name, out["measured_ms"], nbytes, world_size, cap)
        out["contenders"][name] = row
    return out


def plan_ms(name: str, measured_ms: dict[str, float], nbytes: float, world_size: int,
            cap_mb: float | None = None) -> float | None:
    """``lockstep plan``'s step for a contender, given the measured link (a ring fitted to the all-reduce alone) and
    the measured compute: DDP's overlap for the DDPs, the overlapped optimizer step's, compute-then-send for floor,
    half the bytes for fp16. The buckets: ``cap_mb`` (what a contender's trials chose), else the name's cap or 25 MB.
    None where the plan has no model (PowerSGD)."""
    from lockstep.costmodel import Link, bytes_factor
    from lockstep.perf.plan import PlanConfig, overlapped_step_time_s, step_time_s

    if name.endswith("_powersgd") or name in ZERO2:  # the plan has no model of these
        return None
    comm_s = measured_ms["allreduce"] / 1e3 * (0.5 if name.endswith("_fp16") else 1.0)
    bandwidth_gb_s = nbytes * bytes_factor(world_size, "ring") / (measured_ms["allreduce"] / 1e3) / 1e9
    cfg = PlanConfig(params=nbytes / 4, precision="fp32", optimizer="sgd", world_size=world_size,
                     link=Link("measured", 0.0, bandwidth_gb_s), compute_ms=measured_ms["compute"],
                     bucket_cap_mb=cap_mb or cap_of(name) or 25.0)
    if name == "floor":
        return step_time_s(cfg, comm_s)[0] * 1e3
    if name == "lockstep_overlap":
        return overlapped_step_time_s(cfg, comm_s) * 1e3
    return step_time_s(cfg, comm_s)[1] * 1e3


def _ratio_cell(r: dict | None) -> str:
    return "-" if r is None else f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"


def markdown_section(title: str, table: dict) -> list[str]:
    """One rate and model: the measured parts and limits on one line, then a row per contender."""
    m, lim = table["measured_ms"], table["limits_ms"]
    fp16 = (f"the fp16 all-reduce {m['allreduce_fp16']:.1f} ms, {m['allreduce_fp16'] / m['allreduce']:.2f} x the "
            "fp32 one" if "allreduce_fp16" in m else "all-reduce halved")
    lines = [f"### {title}", "",
             f"forward {m['forward']:.1f} ms, compute {m['compute']:.1f} ms, all-reduce {m['allreduce']:.1f} ms; "
             f"DDP limit max(compute, forward + all-reduce) {lim['ddp']:.1f} ms, wire limit max(compute, all-reduce) "
             f"{lim['wire']:.1f} ms (fp16, {fp16}: {lim['ddp_fp16']:.1f} / {lim['wire_fp16']:.1f} ms)", "",
             *([f"compute beside an all-reduce of the gradients' bytes {m['compute_wire']:.1f} ms "
                f"({m['compute_wire'] / m['compute']:.2f} x alone): CPU limit max(that, forward + all-reduce) "
                f"{lim['cpu']:.1f} ms", ""] if "cpu" in lim else []),
             "| contender | ms | x DDP limit | x wire limit | x CPU limit | x torch (same hook) | limits | "
             "plan ms (measured/plan) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in table["contenders"].items():
        ref = f" ({row['torch_ref']})" if row.get("torch_ref", "torch") != "torch" else ""
        plan = row.get("plan_ms")
        plan_cell = "-" if plan is None else f"{plan:.1f} ({row['ms'] / plan:.3f})"
        lines.append(f"| {name} | {row['ms']:.1f} | {_ratio_cell(row['ddp_limit'])} | "
                     f"{_ratio_cell(row['wire_limit'])} | {_ratio_cell(row.get('cpu_limit'))} | "
                     f"{_ratio_cell(row.get('torch'))}{ref} | {row['limits']} | "
                     f"{plan_cell} |")
    sweep = {n: row["ms"] for n, row in table["contenders"].items() if cap_of(n) or n == "lockstep"}
    if "lockstep_auto" in table["contenders"] and len(sweep) > 1:
        best = min(sweep, key=sweep.__getitem__)
        lines += ["", f"lockstep_auto / the best fixed cap of the sweep ({best}): "
                      f"{table['contenders']['lockstep_auto']['ms'] / sweep[best]:.3f}"]
    return [*lines, ""]


def chrome_trace(spans: list[tuple[str, str, float, float, dict]]) -> dict:
    """Spans (name, track, start s, end s, args) as a Chrome trace: one thread per track, times from the first."""
    t0 = min(s[2] for s in spans)
    tracks = sorted(dict.fromkeys(s[1] for s in spans), key=lambda t: t != "compute")  # compute on top
    events: list[dict] = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": t}}
                          for i, t in enumerate(tracks)]
    events += [{"name": name, "cat": track, "ph": "X", "pid": 0, "tid": tracks.index(track),
                "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "args": args}
               for name, track, start, end, args in spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# ---------------------------------------------------------------------------------------------- one rank
def _build(name: str, build: Callable[[], nn.Module], hook_wrap=None):
    """The model and SGD optimizer of one entry; ``hook_wrap`` wraps a torch contender's comm hook (tracing)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    import lockstep

    torch.manual_seed(0)
    module = build()
    model: nn.Module = module
    if name == "floor":
        model = _Floor(module)
    elif name.startswith("torch"):
        # torch's PowerSGD issues its second all-reduce from a future callback: with several buckets, gloo's
        # threads issue them in a different order on each rank (a size mismatch that aborts the run, seen here
        # on every model), so it gets one bucket, the one layout where that cannot happen.
        one_bucket = name == "torch_powersgd"
        model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=ONE_BUCKET_MB if one_bucket else None)
        hook, state = {"torch": (default_hooks.allreduce_hook, None),
                       "torch_fp16": (default_hooks.fp16_compress_hook, None),
                       "torch_powersgd": (torch_powersgd.powerSGD_hook, torch_powersgd.PowerSGDState(
                           process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=POWERSGD_START))}[name]
        if hook_wrap is not None or name != "torch":  # plain torch keeps its built-in C++ all-reduce
            model.register_comm_hook(state, hook if hook_wrap is None else hook_wrap(hook))
    elif name.startswith("lockstep"):
        hooks = lockstep.comm_hooks
        cap = cap_of(name) or ("auto" if name == "lockstep_auto" else None)
        model = lockstep.DistributedDataParallel(module, bucket_cap_mb=cap,
                                                 hierarchical_all_reduce=False if name == "lockstep_flat" else None)
        if name == "lockstep_fp16":
            model.register_comm_hook(None, hooks.fp16_compress_hook)
        elif name == "lockstep_powersgd":
            state = hooks.PowerSGDState(None, 1, start_powerSGD_iter=POWERSGD_START)
            model.register_comm_hook(state, hooks.powersgd_hook)
    if name in ZERO2:
        os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = name.rsplit("_", 1)[1] if name != "lockstep_zero2" else "all_reduce"
        return model, model.zero_optimizer(torch.optim.SGD, stage=2, lr=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if name == "lockstep_overlap":
        opt = model.overlap_optimizer_step(opt)
    return model, opt


def _runner(name: str, model, opt, x, y, flat: torch.Tensor, side_group=None) -> Callable[[], float | None]:
    """One timed slot of an entry: None (the caller times the call) or the seconds it measured itself."""
    def forward() -> None:
        model(x)

    if name == "compute_wire":
        return lambda: _compute_beside_wire(model, opt, x, y, flat, side_group)

    flat16 = flat.to(torch.float16) if name == "allreduce_fp16" else None
    if name == "forward":
        return forward
    if name in ("allreduce", "allreduce_fp16"):
        return lambda: dist.all_reduce(flat if flat16 is None else flat16)
    if name == "lockstep_overlap" or name in ZERO2:
        return lambda: _overlapped_steps(model, opt, x, y)
    return lambda: _step(model, opt, x, y)


def _compute_beside_wire(model, opt, x, y, flat: torch.Tensor, side_group) -> float:
    """Seconds of one compute step (no DDP) while an all-reduce of ``flat`` runs on ``side_group`` (gloo's thread),
    launched just before it; waited for after the timing."""
    work = dist.all_reduce(flat, group=side_group, async_op=True)
    start = time.perf_counter()
    _step(model, opt, x, y)
    elapsed = time.perf_counter() - start
    work.wait()
    return elapsed


def _overlapped_steps(model, opt, x, y) -> float:
    """Three steps back to back (``STEPS_PER_CALL``), the last two timed (per step); then ``finish_step()``.

    Under overlap_optimizer_step a step returns with its buckets still on the wire and the next forward waits
    for them, so a step timed alone is too cheap, and its tail would slow whatever runs next in the rotation.
    The first step starts with nothing in flight; from the end of its ``opt.step()`` to the end of the third's
    is two steady-state periods (each forward waits per layer for the last step's buckets); finish_step() lands
    the third's buckets, a tail a loop pays once, so the next entry starts on an idle wire.
    """
    _step(model, opt, x, y)
    start = time.perf_counter()
    _step(model, opt, x, y)
    _step(model, opt, x, y)
    elapsed = (time.perf_counter() - start) / 2
    model.finish_step()
    return elapsed


def _tx_bytes_path() -> Path:
    """Node 0's veth counter of bytes sent (the interface gloo uses, GLOO_SOCKET_IFNAME)."""
    return Path("/sys/class/net") / os.environ.get("GLOO_SOCKET_IFNAME", "") / "statistics" / "tx_bytes"


def per_step(nbytes_per_call: dict[str, int]) -> dict[str, int]:
    """Bytes a call of each entry sent, as bytes a step (``STEPS_PER_CALL``): what the line compares with DDP's."""
    return {name: round(n / STEPS_PER_CALL.get(name, 1)) for name, n in nbytes_per_call.items()}


def _link_nbytes(run: Callable[[], object]) -> int:
    """Bytes node 0 sent over the link (its veth's ``tx_bytes``, read on every rank) during one ``run()``."""
    counter = _tx_bytes_path()
    dist.barrier()
    before = int(counter.read_text())
    run()
    dist.barrier()  # every rank done: what node 0 sent for this call has left (a barrier's bytes are a few hundred)
    return int(counter.read_text()) - before


def _warm_up(name: str, model, run: Callable[[], object], steps: int) -> None:
    reducer = getattr(model, "reducer", None)
    # "auto"'s trials, and the default's link verdict (third step) and the trials it may start; both are agreed, so
    # every rank runs as many steps here
    tuner = lambda: getattr(reducer, "tuner", None)  # noqa: E731 (torch's reducer has none)
    while getattr(getattr(reducer, "link", None), "pending", False) or (tuner() is not None and not tuner().done):
        run()
    extra = {"lockstep_powersgd": POWERSGD_START, "torch_powersgd": POWERSGD_START,
             "lockstep_overlap": OVERLAP_PROBE_STEPS}.get(name, 0)
    for _ in range(steps + extra):
        run()


def _time_rotation(runs: dict[str, Callable[[], float | None]], steps: int) -> dict[str, list[float]]:
    """Seconds per call of each entry, ``steps`` iterations, the order rotated each iteration, a barrier before each."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for it in range(steps):
        shift = it % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            measured = runs[name]()
            times[name].append(time.perf_counter() - start if measured is None else measured)
    return times


def _measure_model(kind: str, cfg: dict, rank: int) -> dict:
    build, batch = MODELS[kind]
    x, y = batch(torch.Generator().manual_seed(rank))
    params = list(build().parameters())
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(numel)
    entries = (*MEASURES, *cfg["contenders"])
    built = {name: _build(name, build) for name in entries if not name.startswith("allreduce")}
    side_group = dist.new_group(backend="gloo")  # compute_wire's all-reduce, apart from the timed entries' group
    runs = {name: _runner(name, *built.get(name, (None, None)), x, y, flat, side_group) for name in entries}
    for name, run in runs.items():
        _warm_up(name, built.get(name, (None, None))[0], run, cfg["warmup"])
    times = _time_rotation(runs, cfg["blocks"] * cfg["block_steps"])
    summary = _summarise(times, cfg["blocks"], ratios_of=())
    result: dict = {"params": numel, "tensors": len(params), "nbytes": numel * 4}
    chosen_mb = {}
    for name, key in (("lockstep_auto", "auto"), ("lockstep", "default_trials")):  # what the trials chose
        tuned = getattr(getattr(built.get(name, (None,))[0], "reducer", None), "tuner", None)
        if tuned is not None:
            result[key] = tuned.result
            if "chosen_mb" in tuned.result:  # the plan then predicts the step with the chosen buckets
                chosen_mb[name] = tuned.result["chosen_mb"]
    result.update(table=link_table(summary["block_medians_ms"], numel * 4, dist.get_world_size(), chosen_mb),
                  block_medians_ms=summary["block_medians_ms"],
                  link_nbytes_per_step=per_step({name: _link_nbytes(run) for name, run in runs.items()}))
    hier = getattr(getattr(built.get("lockstep", (None,))[0], "reducer", None), "hierarchy", None)
    result["lockstep_hierarchical"] = hier is not None
    if cfg.get("trace"):
        _trace_all(kind, built, x, y, cfg, rank)
        result["wire"] = _wire_accounts(built, x, y, cfg, rank)
    return result


def _recording(spans: list, hook):
    """``hook`` with each bucket's issue and completion recorded (the completion on the backend's thread)."""
    def recorded(state, bucket):
        issued, index, nbytes = time.perf_counter(), bucket.index(), bucket.buffer().numel() * 4

        def done(fut):
            spans.append((f"all-reduce bucket {index}", f"bucket {index}", issued, time.perf_counter(),
                          {"nbytes_fp32": nbytes}))
            return fut.value()

        return hook(state, bucket).then(done)

    return recorded


def _traced_step(model, opt, x, y, spans: list) -> None:
    """One step with its phases as spans (torch's backward includes its final wait for the buckets)."""
    t0 = time.perf_counter()
    opt.zero_grad()
    out = model(x)
    t1 = time.perf_counter()
    F.cross_entropy(out, y).backward()
    t2 = time.perf_counter()
    spans += [("forward", "compute", t0, t1, {}), ("backward", "compute", t1, t2, {})]
    if isinstance(model, _Floor):
        dist.all_reduce(model.flat)
        t3 = time.perf_counter()
        spans.append(("all-reduce (blocking)", "bucket 0", t2, t3, {"nbytes": model.flat.numel() * 4}))
        t2 = t3
    opt.step()
    spans.append(("optimizer step", "compute", t2, time.perf_counter(), {}))


def _trace_all(kind: str, built: dict, x, y, cfg: dict, rank: int) -> None:
    """One traced step per contender: lockstep's recorder on the timed model; torch and floor on a fresh one."""
    for name in cfg["contenders"]:
        out_dir = Path(cfg["trace"]) / cfg["rate"] / kind / name
        if name.startswith("lockstep"):
            _trace_lockstep(name, *built[name], x, y, out_dir)
        else:
            _trace_fresh(name, MODELS[kind][0], x, y, cfg["warmup"], out_dir if rank == 0 else None)


def _wire_accounts(built: dict, x, y, cfg: dict, rank: int) -> dict:
    """One more step of each contender, node 0's ``tx_bytes`` sampled through it on rank 0 (wire_account): where
    the wire idled, per phase of that step. The overlapped steps run one step first, back to back with the sampled
    one, so that its forward waits for the buckets before it as in a loop; its own land after the sampling."""
    counter = _tx_bytes_path()
    accounts = {}
    for name in cfg["contenders"]:
        model, opt = built[name]
        steady = name == "lockstep_overlap" or name in ZERO2
        dist.barrier()  # before the first step: a barrier between the two would wait for the first one's buckets
        if steady:
            _step(model, opt, x, y, finish=False)
        sampler = WireSampler(counter).start() if rank == 0 else None
        spans: list = []
        _traced_step(model, opt, x, y, spans)
        samples = sampler.stop() if sampler is not None else []
        if steady:
            model.finish_step()
        if rank == 0:
            phases = sorted(((n, a, b) for n, _, a, b, _ in spans), key=lambda p: p[1])
            accounts[name] = wire_account.account(samples, rate_bits(cfg["rate"]), phases)
    return accounts


def _trace_lockstep(name: str, model, opt, x, y, out_dir: Path) -> None:
    """lockstep's own recorder (every rank) attached for one more step of the timed model, the optimizer marked."""
    from lockstep.ddp.observe import attach, detach
    from lockstep.diagnostics.trace import TraceRecorder

    overlap = name == "lockstep_overlap"
    if overlap:  # the traced step's forward then waits for this one's buckets, as in a loop
        _step(model, opt, x, y)
    # One step is run and the window written by hand; overlap's window is two steps wide because its reducer
    # counts synchronised steps differently (lockstep's recorder then says the window ended early).
    step = model.reducer.num_syncs + 1
    recorder = TraceRecorder(model.reducer, model.process_group, out_dir, (step, step + overlap), quiet=True)
    model.reducer.observer = attach(model.reducer.observer, recorder)
    dist.barrier()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    start = time.perf_counter()
    opt.step()
    recorder.mark("optimizer step", start, time.perf_counter())
    recorder.write()
    model.reducer.observer = detach(model.reducer.observer, recorder)
    if overlap:
        model.finish_step()


def _trace_fresh(name: str, build, x, y, warmup: int, out_dir: Path | None) -> None:
    """torch's contenders (their hook wrapped to record each bucket) and floor: a fresh model, warmed up, one step."""
    spans: list = []
    model, opt = _build(name, build, hook_wrap=lambda hook: _recording(spans, hook))
    _warm_up(name, model, lambda: _step(model, opt, x, y), warmup)
    spans.clear()
    dist.barrier()
    _traced_step(model, opt, x, y, spans)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "trace.json").write_text(json.dumps(chrome_trace(spans)))


def worker(config_path: str) -> int:
    """One rank, inside its namespace: RANK, WORLD_SIZE, MASTER_ADDR/PORT and GLOO_SOCKET_IFNAME come in the env."""
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        report = {kind: _measure_model(kind, cfg, rank) for kind in cfg["models"]}
        if rank == 0:
            Path(cfg["result"]).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- the launcher
def skip_reason() -> str | None:
    """Why the link cannot be built here (not root, no ip or tc, no namespaces), or None."""
    sys.path.insert(0, str(REPO / "tests"))
    import netns

    reason = netns.unavailable_reason()
    if reason is None and shutil.which("tc") is None:
        reason = "shaping the link needs the `tc` command (apt-get install iproute2)"
    return reason


def _launch(nodes, per_node: int, cfg_path: Path, timeout_s: float) -> bool:
    """Every rank in its namespace; True if all exit 0 (on the first failure the rest are killed)."""
    port = random.randint(20000, 40000)  # the namespaces are fresh: nothing else listens there
    world_size = per_node * len(nodes)
    procs = []
    for n, node in enumerate(nodes):
        for local in range(per_node):
            env = dict(os.environ, RANK=str(n * per_node + local), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(n), MASTER_ADDR=nodes[0].addr,
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=node.interface)
            argv = node.command([sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg_path)])
            procs.append(subprocess.Popen(argv, env=env))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"rank(s) {failed} failed" if failed else f"ranks still running after {timeout_s:.0f} s"
                print(f"link.py: {why}; stopping the others", file=sys.stderr)
                return False
            time.sleep(0.5)
        return all(p.returncode == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def schedule(rate: str, args) -> tuple[int, int, str]:
    """(blocks, block steps, a note) for a rate: fewer steps on a slow link unless the flags say otherwise."""
    blocks, steps = args.blocks or 4, args.block_steps or 4
    if rate_bits(rate) < SLOW_RATE_BITS and args.blocks is None and args.block_steps is None:
        blocks, steps = SLOW_SCHEDULE
        return blocks, steps, f"{blocks} blocks of {steps} steps at {rate} (a step takes seconds there)"
    return blocks, steps, ""


def _shaping_line(rate: str, result: dict, world_size: int) -> str:
    ar_s = result["table"]["measured_ms"]["allreduce"] / 1e3
    bus_gbit = result["nbytes"] * 2 * (world_size - 1) / world_size * 8 / ar_s / 1e9
    return (f"all-reduce of {result['nbytes'] / 1e6:.1f} MB: {ar_s * 1e3:.0f} ms = {bus_gbit:.2f} Gbit/s bus bandwidth "
            f"(shaped at {rate_bits(rate) / 1e9:g} Gbit/s)")


def run_rates(args, contenders: list[str]) -> dict:
    """Build the two nodes once, then for each rate: shape both ends, run every model, print its tables."""
    import netns

    results: dict = {}
    with netns.two_nodes() as nodes, tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            for node in nodes:
                node.shape(rate)
            blocks, steps, note = schedule(rate, args)
            cfg = {"models": args.models, "contenders": contenders, "warmup": args.warmup, "blocks": blocks,
                   "block_steps": steps, "rate": rate, "trace": args.trace, "result": str(Path(tmp) / f"{rate}.json")}
            cfg_path = Path(tmp) / f"{rate}.cfg.json"
            cfg_path.write_text(json.dumps(cfg))
            print(f"link.py: {rate}: {args.ranks_per_node} rank(s) per node, {blocks} blocks of {steps} steps",
                  flush=True)
            if not _launch(nodes, args.ranks_per_node, cfg_path, args.timeout_s):
                results[rate] = {"failed": True, "note": note}
                continue
            results[rate] = {"models": json.loads(Path(cfg["result"]).read_text()), "blocks": blocks,
                             "block_steps": steps, "note": note}
            print("\n".join(_rate_markdown(rate, results[rate], args)), flush=True)
    return results


def _rate_markdown(rate: str, r: dict, args) -> list[str]:
    world_size = 2 * args.ranks_per_node
    lines = [f"## {rate}, 2 nodes x {args.ranks_per_node} rank(s)", ""]
    if r.get("failed"):
        return [*lines, "(the ranks failed: see the output above)", ""]
    if r["note"]:
        lines += [r["note"] + ".", ""]
    for kind, res in r["models"].items():
        lines += markdown_section(f"{rate}, {kind} ({res['params'] / 1e6:.2f}M parameters in {res['tensors']} tensors)",
                                  res["table"])
        lines += [_shaping_line(rate, res, world_size) + ".", _link_bytes_line(res), ""]
        if res.get("wire"):
            lines += ["Where the wire idled: one more step of each, node 0's tx_bytes sampled every "
                      f"{wire_account.SAMPLE_S * 1e3:g} ms (an interval that carried < {wire_account.IDLE_SHARE:.0%} "
                      "of the rate is idle; torch's backward includes its final wait):", "",
                      *wire_account.markdown(res["wire"]), ""]
        for key, said in (("auto", "lockstep_auto chose"), ("default_trials", "lockstep's default went to the trials "
                                                                             "(the link verdict) and chose")):
            auto = res.get(key) or {}
            if "chosen_mb" in auto:
                chosen = "one bucket" if auto["chosen_mb"] is None else f"{auto['chosen_mb']:g} MB buckets"
                lines += [f"{said} {chosen}.", ""]
    return lines


def _link_bytes_line(res: dict) -> str:
    """Node 0's bytes over the link in one step of each entry, as a multiple of the gradients' bytes."""
    sent = res.get("link_nbytes_per_step") or {}
    cells = [f"{name} {n / 1e6:.1f} MB ({n / res['nbytes']:.2f} x)" for name, n in sent.items()
             if name not in ("forward", "compute")]
    hier = "hierarchical" if res.get("lockstep_hierarchical") else "flat"
    return (f"Bytes node 0 sent over the link in one step (x the gradients' {res['nbytes'] / 1e6:.1f} MB; lockstep's "
            f"default was {hier} here): " + ", ".join(cells) + ".")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="100mbit,1gbit,2.5gbit", help="tbf rates, comma-separated (tc's syntax)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"from {','.join(MODELS)}")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"from {','.join(CONTENDERS)}")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks in each namespace (2 for 2 x 2)")
    parser.add_argument("--blocks", type=int, default=None, help="timed blocks (default 4; 2 below 500mbit)")
    parser.add_argument("--block-steps", type=int, default=None, help="steps per block (default 4; 2 below 500mbit)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender (more for auto, PowerSGD)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per rate, all models")
    parser.add_argument("--trace", default="", metavar="DIR", help="a Chrome trace of one step of each contender")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="'' to write nothing")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    _check_args(parser, args)
    reason = skip_reason()
    if reason is not None:
        print(f"link.py: skipped: {reason}")
        return 0
    contenders, notes = list(args.contenders), []
    if "lockstep_overlap" in contenders and not _has_overlap():
        contenders.remove("lockstep_overlap")
        notes.append("lockstep_overlap skipped: this lockstep's DistributedDataParallel has no overlap_optimizer_step")
    if args.trace:
        args.trace = str(Path(args.trace).resolve())
    for note in notes:
        print(f"link.py: {note}")
    load_before = os.getloadavg()
    started = datetime.datetime.now()
    try:
        results = run_rates(args, contenders)
    except KeyboardInterrupt:  # two_nodes() has removed the namespaces and _launch killed the ranks by now
        print("link.py: interrupted; the ranks are stopped and the namespaces removed", file=sys.stderr)
        return 130
    _write(args, results, notes, load_before, started)
    return 0 if not any(r.get("failed") for r in results.values()) else 1


def _has_overlap() -> bool:
    import lockstep

    return hasattr(lockstep.DistributedDataParallel, "overlap_optimizer_step")


def _check_args(parser, args) -> None:
    """Comma lists to lists, every name and rate checked: exit 2 naming the flag."""
    args.models, args.contenders, args.rates = args.models.split(","), args.contenders.split(","), args.rates.split(",")
    for flag, names, known in (("--models", args.models, MODELS), ("--contenders", args.contenders, CONTENDERS)):
        for name in names:
            if name not in known and not (flag == "--contenders" and cap_of(name)):
                parser.error(f"{flag}: unknown {flag[2:-1]} {name!r}; choose from {','.join(known)}")
    for rate in args.rates:
        try:
            rate_bits(rate)
        except ValueError as e:
            parser.error(f"--rates: {e}")
    for flag, value in (("--ranks-per-node", args.ranks_per_node), ("--blocks", args.blocks),
                        ("--block-steps", args.block_steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")


def _write(args, results: dict, notes: list[str], load_before, started) -> None:
    load_after = os.getloadavg()
    lines = [f"# DDP step over a shaped link: 2 nodes x {args.ranks_per_node} rank(s), 1 thread each, gloo over a veth "
             f"pair with tbf, torch {torch.__version__} ({started:%Y-%m-%d %H:%M})", "",
             "A shared machine (other engineers' tests run beside it): load average (1/5/15 min) before "
             f"{' / '.join(f'{v:.2f}' for v in load_before)}, after {' / '.join(f'{v:.2f}' for v in load_after)}. "
             "ms: median of per-block medians; ratios: median of per-block ratios [min-max]. DDP limit = max(compute, "
             "forward + all-reduce), wire limit = max(compute, all-reduce); fp16 rows use their own (the "
             "fp16 all-reduce as measured); x torch compares with torch's DDP with the same hook.", ""]
    lines += [f"{note}." for note in notes] + ([""] if notes else [])
    for rate, r in results.items():
        lines += _rate_markdown(rate, r, args)
    text = "\n".join(lines)
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    stem = Path(args.out) / f"link-{started:%Y-%m-%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text + "\n")
    record = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "worker")}, "torch": torch.__version__,
              "notes": notes, "load_average_before": load_before, "load_average_after": load_after, "results": results}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    print(f"link.py: wrote {stem}.md and .json")


if __name__ == "__main__":
    sys.exit(main())
