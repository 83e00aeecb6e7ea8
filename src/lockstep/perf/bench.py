"""``lockstep bench allreduce``: time every all-reduce algorithm side by side.

The command spawns its own ranks (gloo on 127.0.0.1, one thread each), and for
every buffer size runs the algorithms round-robin within each iteration, so the
machine's load drifts over all of them alike and their ratio is fair even on a
shared box. A call lasts from the last rank's start to the last rank's finish
(the ranks share one host's monotonic clock), and a size's time is the median
over iterations. From those it
prints algorithm and bus bandwidth (NCCL-tests' definitions), fits the alpha-beta
model of each algorithm (``lockstep.costmodel``), reports ring / native bus
bandwidth at >= 4 MiB, and writes JSON, markdown and a PNG plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from lockstep.costmodel import ALGORITHMS, bus_bandwidth_gb_s, fit_link
from lockstep.perf.spawn import DEFAULT_OUT, OUT_HELP, report_to_parent, results_dir, spawn_and_collect

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
RATIO_MIN_NBYTES = 4 << 20


def parse_size(text: str) -> int:
    """'4KiB', '256MiB', '1048576' -> bytes."""
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits) :]
    if unit not in _UNITS or not digits:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number with an optional KiB/MiB/GiB unit")
    return int(float(digits) * _UNITS[unit])


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def sizes_between(min_nbytes: int, max_nbytes: int, factor: int) -> list[int]:
    sizes, n = [], min_nbytes
    while n <= max_nbytes:
        sizes.append(n)
        n *= factor
    return sizes


def _worker(rank, world_size, port, cfg, queue):
    """One spawned rank: time every (size, algorithm); rank 0 puts the results on ``queue``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with report_to_parent(rank, queue) as rows:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=cfg["timeout_s"]),
        )
        rows += measure(rank, world_size, cfg, one_clock=True)


def measure(rank: int, world_size: int, cfg: dict, one_clock: bool) -> list[dict]:
    """Time every (size, algorithm) on the default group; every rank returns the same rows.

    ``one_clock``: the ranks share one host's monotonic clock, so a call lasted from the last rank's start to the
    last rank's finish (the barrier's skew drops out). Across hosts (``lockstep launch`` on several nodes) clocks
    differ: a call lasted the longest of the ranks' own spans, start to finish after the barrier.
    """
    import torch
    import torch.distributed as dist

    from lockstep.collectives import all_reduce

    rows: list[dict] = []
    dtype = getattr(torch, cfg["dtype"])
    algos = cfg["algorithms"]
    for nbytes in cfg["sizes"]:
        numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        buf = torch.empty(numel, dtype=dtype)
        for algo in algos:  # warm-up that also checks the answer: sum of (rank+1) over ranks
            buf.fill_(rank + 1)
            all_reduce(buf, algorithm=algo)
            if not bool((buf == world_size * (world_size + 1) // 2).all()):
                raise RuntimeError(f"{algo} all-reduce of {nbytes} bytes gave a wrong sum on rank {rank}")
        buf.zero_()  # 0 + 0 stays 0: repeated sums never overflow or go subnormal
        spans = [_timed(all_reduce, buf, a, dist) for a in algos]
        probe = torch.tensor([end - start for start, end in spans], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # every rank derives the same iteration count
        iters = int(max(cfg["min_iters"], min(cfg["iters"], cfg["budget_s"] / max(probe.sum().item(), 1e-9))))
        starts = torch.zeros(iters, len(algos), dtype=torch.float64)
        ends = torch.zeros_like(starts)
        for i in range(iters):
            for j in range(len(algos)):
                k = (i + j) % len(algos)  # rotate who goes first: no algorithm always follows another
                starts[i, k], ends[i, k] = _timed(all_reduce, buf, algos[k], dist)
        if one_clock:
            dist.all_reduce(starts, op=dist.ReduceOp.MAX)
            dist.all_reduce(ends, op=dist.ReduceOp.MAX)
            times = ends - starts
        else:
            times = ends - starts
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        for k, algo in enumerate(algos):
            rows.append({"algorithm": algo, "nbytes": numel * buf.element_size(), "iters": iters,
                         "median_s": statistics.median(times[:, k].tolist()), "min_s": times[:, k].min().item()})
        del buf
    return rows


def launched() -> tuple[int, int] | None:
    """(rank, world size) when a launcher (``lockstep launch``, torchrun) started this process as one of several
    ranks; None when run alone (the command then spawns its own ranks on this host)."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return (int(env["RANK"]), int(env["WORLD_SIZE"])) if int(env["WORLD_SIZE"]) > 1 else None


def run_launched(rank: int, world_size: int, cfg: dict) -> list[dict]:
    """This process is one of a launcher's ranks (``lockstep launch -m lockstep bench allreduce``): join its group
    (gloo, the launcher's environment) and time the link between the launcher's nodes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        rows = measure(rank, world_size, cfg, one_clock=local_world == world_size)
    finally:
        dist.destroy_process_group()
    return with_bandwidths(rows, world_size)


def with_bandwidths(rows: list[dict], world_size: int) -> list[dict]:
    """Each row's algorithm and bus bandwidth (NCCL-tests' definitions), from its median time."""
    for row in rows:
        row["algbw_gb_s"] = row["nbytes"] / row["median_s"] / 1e9
        row["busbw_gb_s"] = bus_bandwidth_gb_s(row["nbytes"], world_size, row["median_s"])
    return rows


def _timed(all_reduce, buf, algo, dist) -> tuple[float, float]:
    dist.barrier()  # start together: otherwise we time the previous call's stragglers
    t0 = time.perf_counter()
    all_reduce(buf, algorithm=algo)
    return t0, time.perf_counter()


def run(sizes, algorithms=ALGORITHMS, world_size=2, iters=20, min_iters=3, budget_s=6.0, dtype="float32",
        timeout_s=600.0):
    """Spawn ``world_size`` gloo ranks on this host and return the timing rows."""
    from lockstep.process_group import free_port

    port = free_port()
    cfg = dict(sizes=list(sizes), algorithms=list(algorithms), iters=iters, min_iters=min_iters,
               budget_s=budget_s, dtype=dtype, timeout_s=timeout_s)
    payload = spawn_and_collect(_worker, world_size, port, cfg, timeout_s, "bench")
    return with_bandwidths(payload, world_size)


def summarise(rows, world_size: int) -> dict:
    """Alpha-beta fit per algorithm and the ring / native bus bandwidth ratio at >= 4 MiB."""
    algos = sorted({r["algorithm"] for r in rows}, key=list(ALGORITHMS).index)
    fits: dict[str, dict[str, dict[str, float | str]]] = {"median": {}, "min": {}}  # stat -> algorithm -> fit
    for stat, by in fits.items():
        for algo in algos:
            mine = [r for r in rows if r["algorithm"] == algo]
            try:
                link = fit_link([r["nbytes"] for r in mine], [r[f"{stat}_s"] for r in mine], world_size, algo,
                                name=algo)
                by[algo] = {"alpha_us": link.alpha_s * 1e6, "bandwidth_gb_s": link.bandwidth_gb_s}
            except ValueError as e:
                by[algo] = {"error": str(e)}
    ratios = {}
    by_key = {(r["algorithm"], r["nbytes"]): r for r in rows}
    for (algo, nbytes), r in sorted(by_key.items(), key=lambda kv: kv[0][1]):
        native = by_key.get(("native", nbytes))
        if algo == "ring" and native and nbytes >= RATIO_MIN_NBYTES:
            ratios[nbytes] = r["busbw_gb_s"] / native["busbw_gb_s"]
    return {"fits": fits, "ring_over_native_busbw": ratios,
            "ring_over_native_median": statistics.median(ratios.values()) if ratios else None}


def format_report(rows, summary, world_size: int, where: str = "gloo ranks (127.0.0.1)") -> str:
    lines = [f"all-reduce on {world_size} {where}, median over iterations of a call's span", "",
             "| size | algorithm | iters | median ms | algbw GB/s | busbw GB/s |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {human(r['nbytes'])} | {r['algorithm']} | {r['iters']} | {r['median_s'] * 1e3:.3f} "
                     f"| {r['algbw_gb_s']:.3f} | {r['busbw_gb_s']:.3f} |")
    lines += ["", "alpha-beta fit (t = steps*alpha + bytes_factor*n/B; see lockstep.costmodel), least squares in"
              " relative error, on the median and on the fastest iteration (interference from other processes"
              " only adds time, so the fastest run is the closest to the link itself):"]
    for stat, by in summary["fits"].items():
        for algo, fit in by.items():
            lines.append(f"- {algo} ({stat}): " + (fit["error"] if "error" in fit else
                         f"alpha = {fit['alpha_us']:.1f} us, B = 1/beta = {fit['bandwidth_gb_s']:.3f} GB/s"))
    if summary["ring_over_native_busbw"]:
        per = ", ".join(f"{human(n)}: {v:.2f}" for n, v in summary["ring_over_native_busbw"].items())
        lines += ["", f"ring / native bus bandwidth at >= 4 MiB: {per}; "
                      f"median {summary['ring_over_native_median']:.2f} (target >= 0.8)"]
    return "\n".join(lines)


def plot(rows, path: Path, world_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo in sorted({r["algorithm"] for r in rows}, key=list(ALGORITHMS).index):
        mine = [r for r in rows if r["algorithm"] == algo]
        ax.plot([r["nbytes"] for r in mine], [r["busbw_gb_s"] for r in mine], marker="o", label=algo)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("buffer size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce bus bandwidth, {world_size} gloo ranks on 127.0.0.1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cli_main(argv: list[str]) -> int:
    if argv and argv[0] == "scaling":  # its own module: ``lockstep bench scaling``
        from lockstep.perf.scaling import cli_main as scaling_main

        return scaling_main(argv[1:])
    parser = argparse.ArgumentParser(prog="lockstep bench", description="lockstep benchmarks")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("allreduce", help="time native, ring and tree all-reduce on local gloo ranks")
    sub.add_parser("scaling", help="step time and efficiency from 1 to N ranks, beside the plan (see --help after it)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default 2); under a launcher (lockstep launch -m lockstep bench allreduce) "
                        "the launcher's ranks run it, over the link between its nodes")
    p.add_argument("--min-size", type=parse_size, default=4 << 10, help="smallest buffer (default 4KiB)")
    p.add_argument("--max-size", type=parse_size, default=256 << 20, help="largest buffer (default 256MiB)")
    p.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--iters", type=int, default=20, help="most timed iterations per size (default 20)")
    p.add_argument("--budget-s", type=float, default=6.0,
                   help="time budget per size; fewer iters for big sizes (min 3)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset of native,ring,tree")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args(argv)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        p.error(f"argument --algorithms: {bad or algorithms} not in {list(ALGORITHMS)}")
    ranks = launched()
    if ranks is not None and args.nproc is not None:
        p.error(f"argument --nproc: under a launcher its {ranks[1]} ranks run the benchmark (WORLD_SIZE); "
                "leave --nproc out")
    nproc = ranks[1] if ranks is not None else 2 if args.nproc is None else args.nproc
    for flag, ok, need in (("--nproc", 2 <= nproc <= 64, "between 2 and 64"),
                           ("--factor", args.factor >= 2, ">= 2"),
                           ("--iters", args.iters >= 1, ">= 1"), ("--min-size", args.min_size >= 1, ">= 1 byte"),
                           ("--max-size", args.max_size >= args.min_size, ">= --min-size"),
                           ("--budget-s", args.budget_s > 0, "> 0")):
        if not ok:
            p.error(f"argument {flag}: must be {need}, got {getattr(args, flag[2:].replace('-', '_'))}")
    rank0 = ranks is None or ranks[0] == 0
    out = results_dir(p, args.out) if rank0 else None
    sizes = sizes_between(args.min_size, args.max_size, args.factor)
    cfg = dict(sizes=sizes, algorithms=algorithms, iters=args.iters, min_iters=min(3, args.iters),
               budget_s=args.budget_s, dtype=args.dtype, timeout_s=600.0)
    try:
        if ranks is None:
            rows = run(sizes, algorithms, nproc, iters=args.iters, min_iters=min(3, args.iters),
                       budget_s=args.budget_s, dtype=args.dtype)
        else:
            rows = run_launched(ranks[0], nproc, cfg)
    except RuntimeError as e:  # a rank died or timed out: spawn_and_collect names which
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    if not rank0:
        return 0  # rank 0 reports: every rank measured the same calls
    args.nproc = nproc
    where = "gloo ranks (127.0.0.1)" if ranks is None else \
        f"gloo ranks started by a launcher ({nproc // int(os.environ.get('LOCAL_WORLD_SIZE', nproc))} node(s))"
    summary = summarise(rows, args.nproc)
    report = format_report(rows, summary, args.nproc, where)
    print(report)
    if out is not None:
        stem = out / f"allreduce_{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d_%H%M%S}_n{args.nproc}"
        meta = {"world_size": args.nproc, "dtype": args.dtype, "backend": "gloo", "host_cpus": os.cpu_count(),
                "where": where,
                "python": sys.version.split()[0], "argv": argv,
                # The box is shared: the load says how much CPU the ranks were competing for.
                "load_average_1_5_15": os.getloadavg()}
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
        stem.with_suffix(".md").write_text(f"# all-reduce benchmark\n\n`lockstep bench {' '.join(argv)}`\n\n"
                                         f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
                                         f"at the end\n\n{report}\n")
        plot(rows, stem.with_suffix(".png"), args.nproc)
        print(f"\nwrote {stem}.json, .md, .png")
    return 0
