"""Where lockstep's per-step time goes beyond the floor's, measured in CPU time (steady on a loaded machine).

2 ranks on gloo, 1 thread each, the models of ``ddp_step.py``. On rank 0, for each model: the main thread's
CPU time per step (``time.thread_time``: gloo's threads and the time spent waiting for the peer left out) of
``floor`` (compute, then one blocking all-reduce of the gradients' bytes), ``compute`` and lockstep's default,
interleaved, medians; then lockstep's steps under cProfile, its own functions listed in microseconds per
step (cProfile's own cost inflates per-call Python time; the unprofiled totals are the figures to compare)
and, under torch.profiler, the aten ops its reducer runs (the copies in and back, the scaling).

    python benchmarks/step_profile.py [--models mlp,cnn,transformer] [--steps 30]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import MODELS, _build, _step, run_ranks

CONTENDERS = ("compute", "floor", "lockstep_25")


def _cpu_per_step(models, optims, x, y, steps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for it in range(steps):
        shift = it % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.thread_time()
            _step(models[name], optims[name], x, y)
            times[name].append(time.thread_time() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def _lockstep_functions(profile: cProfile.Profile, steps: int) -> list[tuple[str, int, float, float]]:
    """(function, calls per step, own us per step, cumulative us per step) of lockstep's own code."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.items():
        if "/lockstep/" in path:
            where = f"{path.split('/lockstep/', 1)[1]}:{line} {name}"
            rows.append((where, round(calls / steps), tottime / steps * 1e6, cumtime / steps * 1e6))
    return sorted(rows, key=lambda r: -r[2])


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        report = {}
        for kind in args.models:
            build, batch = MODELS[kind]
            models = {name: _build(name, build) for name in CONTENDERS}
            optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()}
            x, y = batch(torch.Generator().manual_seed(rank))
            _cpu_per_step(models, optims, x, y, 3)  # warm-up: the rebuild, lazy initialisation
            cpu = _cpu_per_step(models, optims, x, y, args.steps)
            model, opt = models["lockstep_25"], optims["lockstep_25"]
            profile = cProfile.Profile(time.thread_time)  # CPU time: a loaded machine's preemptions left out
            for _ in range(args.steps):
                dist.barrier()
                profile.enable()
                _step(model, opt, x, y)
                profile.disable()
            ops: dict[str, tuple[int, float]] = {}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    dist.barrier()
                    _step(model, opt, x, y)
            for event in prof.key_averages():
                ops[event.key] = (event.count // 5, event.self_cpu_time_total / 5)
            params = list(model.module.parameters())
            report[kind] = {"cpu_us": cpu, "functions": _lockstep_functions(profile, args.steps)[:25], "ops": ops,
                            "tensors": len(params), "buckets": len(model.reducer.buckets),
                            "direct": sum(b.plan.direct for b in model.reducer.buckets)}
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


def markdown(report: dict, steps: int) -> str:
    lines = [f"# lockstep's per-step CPU time over the floor, 2 ranks x 1 thread, gloo, torch {torch.__version__}", "",
             (f"Main-thread CPU time per step on rank 0, median of {steps} interleaved steps (waits for the peer and "
             "gloo's threads left out)."), "",
             "| model | tensors | buckets (direct) | compute us | floor us | lockstep_25 us | lockstep - floor us |",
             "|---|---|---|---|---|---|---|"]
    for kind, r in report.items():
        c = r["cpu_us"]
        lines.append(f"| {kind} | {r['tensors']} | {r['buckets']} ({r['direct']}) | {c['compute']:.0f} | {c['floor']:.0f} | "
                     f"{c['lockstep_25']:.0f} | {c['lockstep_25'] - c['floor']:+.0f} |")
    for kind, r in report.items():
        lines += ["", f"## {kind}: lockstep's functions under cProfile, main-thread CPU time (us per step; inflated by the profiler)", "",
                  "| function | calls/step | own us | cumulative us |", "|---|---|---|---|"]
        for where, calls, own, cum in r["functions"][:15]:
            lines.append(f"| `{where}` | {calls} | {own:.0f} | {cum:.0f} |")
        lines += ["", f"{kind}: the reducer's aten ops under torch.profiler (self CPU us per step)", "",
                  "| op | calls/step | self us |", "|---|---|---|"]
        wanted = ("aten::mul", "aten::_foreach_copy_", "aten::copy_", "aten::div_", "aten::mul_", "aten::zero_",
                  "aten::fill_", "aten::view", "aten::as_strided", "aten::detach", "aten::empty", "aten::lift_fresh",
                  "aten::item", "aten::_local_scalar_dense", "aten::select")
        for op in wanted:
            if op in r["ops"]:
                calls, us = r["ops"][op]
                lines.append(f"| {op} | {calls} | {us:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="", help="a markdown file to write the tables to")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    report = run_ranks(_worker, 2, args)
    if report is None:
        return 1
    text = markdown(report, args.steps)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
