"""What the diagnostics cost: lockstep's step with the NaN check, replica checks or tracing on, beside plain
lockstep, torch's C++ DDP and the naive reducer, side by side in one run (``--diagnostics``).

(The step-time benchmark against torch's DDP proper is ``benchmarks/ddp_step.py``.)

2 ranks on gloo, ``torch.set_num_threads(1)`` each. Every iteration runs one training
step of each contender, in a rotating order (so none always goes first), after a
barrier; rank 0's wall time per step is recorded and the medians are compared.

    python benchmarks/diagnostics_cost.py [--steps 30] [--warmup 5] [--models mlp,transformer] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from ddp_step import MODELS  # noqa: E402  the same models as the step benchmark


def _contenders(build, bucket_view: bool, diagnostics: bool = False):
    import tempfile

    import lockstep

    torch.manual_seed(0)
    models = {
        "lockstep": lockstep.DistributedDataParallel(build()),
        "torch": nn.parallel.DistributedDataParallel(build()),
        "naive": lockstep.NaiveDistributedDataParallel(build()),
    }
    if diagnostics:
        # The diagnostics' cost, side by side with plain lockstep: the NaN check, the replica check every 10
        # steps, and a timeline recording every step (a window that never closes while timed).
        models["lockstep_nonfinite"] = lockstep.DistributedDataParallel(build(), detect_nonfinite=True)
        models["lockstep_replicas10"] = lockstep.DistributedDataParallel(build(), check_replicas_every=10)
        models["lockstep_trace"] = lockstep.DistributedDataParallel(
            build(), trace_dir=tempfile.mkdtemp(prefix="lockstep_bench_trace_"), trace_steps=(1, 10**9))
    if bucket_view:
        # The zero-copy path: grads live in the buckets (and zero_grad keeps them there, set_to_none=False).
        models["lockstep_view"] = lockstep.DistributedDataParallel(build(), gradient_as_bucket_view=True)
        models["torch_view"] = nn.parallel.DistributedDataParallel(build(), gradient_as_bucket_view=True)
    return models


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        report = {}
        for kind in args.models:
            build, batch = MODELS[kind]
            models = _contenders(build, args.bucket_view, args.diagnostics)
            optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()}
            gen = torch.Generator().manual_seed(rank)
            x, y = batch(gen)
            times: dict[str, list[float]] = {name: [] for name in models}
            cpu_times: dict[str, list[float]] = {name: [] for name in models}
            names = list(models)
            for it in range(args.warmup + args.steps):
                order = names[it % len(names):] + names[: it % len(names)]
                for name in order:
                    model, opt = models[name], optims[name]
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    opt.zero_grad(set_to_none=not name.endswith("_view"))
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                    if it >= args.warmup:
                        times[name].append(elapsed)
                        cpu_times[name].append(cpu)
            medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            # CPU time of this process (all its threads, gloo's included): less sensitive to a busy machine.
            cpu_medians = {name: statistics.median(t) * 1e3 for name, t in cpu_times.items()}
            params = sum(p.numel() for p in models["torch"].parameters())
            tensors = len(list(models["torch"].parameters()))
            if args.bucket_view:
                medians_view = medians["lockstep_view"] / medians["torch_view"]
            report[kind] = {"params": params, "tensors": tensors, "median_ms": medians, "cpu_median_ms": cpu_medians,
                            **({"ratio_view_lockstep_over_torch": medians_view} if args.bucket_view else {}),
                            "ratio_lockstep_over_torch": medians["lockstep"] / medians["torch"],
                            "cpu_ratio_lockstep_over_torch": cpu_medians["lockstep"] / cpu_medians["torch"],
                            **({"diagnostics_over_lockstep": {n: medians[n] / medians["lockstep"] for n in medians if n.startswith("lockstep_")},
                                "cpu_diagnostics_over_lockstep": {n: cpu_medians[n] / cpu_medians["lockstep"] for n in medians
                                                                  if n.startswith("lockstep_")}} if args.diagnostics else {})}
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--bucket-view", action="store_true", help="also time gradient_as_bucket_view=True for both")
    parser.add_argument("--diagnostics", action="store_true",
                        help="also time detect_nonfinite, check_replicas_every=10 and tracing (results: ddp_step_diagnostics_DATE)")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    for kind in args.models:
        if kind not in MODELS:
            parser.error(f"--models: unknown model {kind!r}; choose from {sorted(MODELS)}")
    if args.steps < 20:
        print("note: fewer than 20 timed steps; medians will be noisy", file=sys.stderr)
    from lockstep.process_group import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    report = queue.get(timeout=1800)
    for p in procs:
        p.join()
    lines = [
        f"# DDP step time, 2 ranks x 1 thread, gloo, torch {torch.__version__} ({datetime.date.today()})",
        "",
        f"medians of {args.steps} steps after {args.warmup} warm-up, contenders interleaved",
        "",
        "| model | params | tensors | lockstep ms | torch DDP ms | naive ms | lockstep/torch | CPU ms lockstep / torch / naive | CPU lockstep/torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in report.items():
        m, c = r["median_ms"], r["cpu_median_ms"]
        lines.append(
            f"| {kind} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {m['lockstep']:.1f} | {m['torch']:.1f} | "
            f"{m['naive']:.1f} | {r['ratio_lockstep_over_torch']:.3f} | "
            f"{c['lockstep']:.1f} / {c['torch']:.1f} / {c['naive']:.1f} | {r['cpu_ratio_lockstep_over_torch']:.3f} |"
        )
    for kind, r in report.items():
        if "ratio_view_lockstep_over_torch" in r:
            m = r["median_ms"]
            lines.append(
                f"\n{kind}, gradient_as_bucket_view=True: lockstep {m['lockstep_view']:.1f} ms, torch {m['torch_view']:.1f} ms, "
                f"ratio {r['ratio_view_lockstep_over_torch']:.3f}; vs torch's default path: "
                f"{m['lockstep_view'] / m['torch']:.3f}"
            )
    for kind, r in report.items():
        if "diagnostics_over_lockstep" in r:
            m, c = r["median_ms"], r["cpu_median_ms"]
            lines += [f"\n{kind}, diagnostics against plain lockstep (wall ms, ratio; CPU ms, ratio):"]
            lines += [f"- {n}: {m[n]:.1f} ms, {v:.3f}; CPU {c[n]:.1f} ms, {r['cpu_diagnostics_over_lockstep'][n]:.3f}"
                      for n, v in r["diagnostics_over_lockstep"].items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d")
        stem = f"ddp_step_diagnostics_{stamp}" if args.diagnostics else f"ddp_step_{stamp}"
        with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
            f.write(text + f"\n\nload average at the end: {os.getloadavg()}\n")
        with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
            json.dump({"steps": args.steps, "warmup": args.warmup, "torch": torch.__version__, "results": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
