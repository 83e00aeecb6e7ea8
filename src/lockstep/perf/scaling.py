"""``lockstep bench scaling``: how the step time changes from 1 rank to N, measured beside the plan's prediction.

For each world size N the command spawns N ranks on this host (gloo on CPU, one thread each; NCCL with
one GPU each where there are GPUs), trains the model with lockstep's DDP on generated data and times
each step as the slowest rank's (a barrier before each step, as in ``lockstep bench allreduce``).

- strong scaling: a fixed global batch B, B / N per rank; efficiency T1 / (N * TN).
- weak scaling: a fixed per-rank batch; efficiency T1 / TN.

The communication share is the time ranks spent waiting for all-reduces at the end of backward (what
overlap did not hide) over the step time. The prediction is ``lockstep plan``'s (``perf.plan``) for the
same parameter count and link, with the compute time measured at N = 1 and scaled by the per-rank
batch. Ranks beyond the cores (CPU) or GPUs there are are not run: they would time-share a device, and
the step time would measure the scheduler rather than the scaling.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from lockstep.costmodel import LINKS, Link, link_from_bench
from lockstep.perf.plan import PlanConfig, make_plan
from lockstep.perf.spawn import DEFAULT_OUT, OUT_HELP, report_to_parent, results_dir, spawn_and_collect

MODES = ("strong", "weak")


def build_model(spec: str):
    """(model, make_batch(batch_size, generator) -> (inputs, integer targets)) for a built-in name or module:factory."""
    import torch
    from torch import nn

    if spec == "mlp":  # 1.6M parameters, 6 tensors
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return model, lambda n, g: (torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))
    if spec == "cnn":  # 32x32 RGB images, 0.5M parameters
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))
        return model, lambda n, g: (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    if spec == "transformer":  # embedding + 4 encoder layers + head: 52 tensors, 2.2M parameters
        return _Transformer(), lambda n, g: (torch.randint(0, 1000, (n, 32), generator=g),
                                             torch.randint(0, 10, (n,), generator=g))
    if spec.count(":") != 1:
        raise ValueError(f"--model must be mlp, cnn, transformer or module:factory, got {spec!r}")
    module_name, factory_name = spec.split(":")
    built = getattr(importlib.import_module(module_name), factory_name)()
    model, make_batch = built if isinstance(built, tuple) else (built, getattr(built, "make_batch", None))
    return model, make_batch or _inferred_batch(model, spec)


def _inferred_batch(model, spec: str):
    """Inputs for a model that says nothing about them: from its first layer (Linear or Embedding) and last Linear."""
    import torch
    from torch import nn

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    if not layers or not isinstance(layers[0], (nn.Linear, nn.Embedding)) or not isinstance(layers[-1], nn.Linear):
        raise ValueError(f"--model {spec}: give the model a make_batch(batch_size, generator) method or return "
                         "(model, make_batch) from the factory: its inputs cannot be read off its first layer")
    first, classes = layers[0], layers[-1].out_features
    if isinstance(first, nn.Embedding):
        return lambda n, g: (torch.randint(0, first.num_embeddings, (n, 16), generator=g),
                             torch.randint(0, classes, (n,), generator=g))
    return lambda n, g: (torch.randn(n, first.in_features, generator=g), torch.randint(0, classes, (n,), generator=g))


def _Transformer():
    from torch import nn

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 192)
            layer = nn.TransformerEncoderLayer(192, 4, 768, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(192, 10)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)).mean(1))

    return Transformer()


def _worker(rank: int, world_size: int, port: int, cfg: dict, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lockstep.ddp.wrapper import DistributedDataParallel

    torch.set_num_threads(cfg["threads"])
    with report_to_parent(rank, queue) as rows:
        cuda = cfg["cuda"]
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        for mode in cfg["modes"]:
            batch = cfg["batch"] // world_size if mode == "strong" else cfg["batch"]
            torch.manual_seed(0)
            model, make_batch = build_model(cfg["model"])
            ddp = DistributedDataParallel(model.to(device), device_ids=[rank] if cuda else None)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            x, y = (t.to(device) for t in make_batch(batch, g))
            spans = []
            for step in range(cfg["warmup"] + cfg["steps"]):
                if step == cfg["warmup"]:
                    wait0 = ddp.reducer.comm_wait_s
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
                spans.append((start, time.perf_counter()))
            timed = spans[cfg["warmup"]:]
            # The slowest rank sets the pace: per step, the latest finish minus the latest start.
            stats = torch.tensor([[s for s, _ in timed], [e for _, e in timed]], dtype=torch.float64, device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            # Each rank's wait and its own busy time (its waits lie inside its own steps, so the share stays <= 1;
            # a median paced step beside a mean wait did not: 1.2 once, when one of 3 steps waited long).
            waits = torch.tensor([ddp.reducer.comm_wait_s - wait0, sum(e - s for s, e in timed)],
                                 dtype=torch.float64, device=device)
            dist.all_reduce(waits)
            step_times = (stats[1] - stats[0]).tolist()
            rows.append({"mode": mode, "world_size": world_size, "batch_per_rank": batch,
                         "global_batch": batch * world_size,
                         "step_s": statistics.median(step_times), "step_s_all": step_times,
                         "comm_wait_s_per_step": waits[0].item() / world_size / len(timed),
                         "rank_step_s_mean": waits[1].item() / world_size / len(timed),
                         "params": sum(p.numel() for p in model.parameters()),
                         "tensors": sum(1 for _ in model.parameters())})


def modes_to_run(world_size: int, modes: list[str]) -> list[str]:
    """At N = 1 strong and weak scaling are the same run (the whole batch on one rank): measure it once."""
    return modes[:1] if world_size == 1 else modes


def reuse_single_rank_run(rows: list[dict], modes: list[str]) -> list[dict]:
    """The rows of one world size, with the N = 1 measurement copied to every mode it stands for."""
    if len(rows) == 1 and rows[0]["world_size"] == 1 and len(modes) > 1:
        measured = rows[0]["mode"]
        rows = [dict(rows[0], mode=mode, measured_as=measured) for mode in modes]
    return rows


def run_world(world_size: int, cfg: dict) -> list[dict]:
    """Spawn ``world_size`` ranks and return their rows (one per mode)."""
    from lockstep.process_group import free_port

    return spawn_and_collect(_worker, world_size, free_port(), cfg, cfg["timeout_s"], "scaling")


def add_efficiency_and_prediction(rows: list[dict], link: Link) -> None:
    """Efficiency against N = 1 of the same mode, the communication share, and the plan's prediction, per row."""
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        base = next((r for r in mine if r["world_size"] == 1), None)
        for r in mine:
            n = r["world_size"]
            r["samples_per_s"] = r["global_batch"] / r["step_s"]
            r["comm_share"] = r["comm_wait_s_per_step"] / r.get("rank_step_s_mean", r["step_s"])  # a rank's own steps
            if base is None:
                r["efficiency"] = r["predicted_step_s"] = r["predicted_efficiency"] = None
                continue
            t1 = base["step_s"]
            r["efficiency"] = t1 / (n * r["step_s"]) if mode == "strong" else t1 / r["step_s"]
            # compute scales with the per-rank batch
            compute_ms = t1 * 1e3 * r["batch_per_rank"] / base["batch_per_rank"]
            plan = make_plan(PlanConfig(params=float(r["params"]), precision="fp32", optimizer="sgd-nomomentum",
                                        world_size=n, link=link, compute_ms=compute_ms, device_memory_gb=1e6))
            assert plan.step_ms is not None  # make_plan predicts a step whenever compute_ms is given
            predicted = plan.step_ms["overlap"] / 1e3 if n > 1 else compute_ms / 1e3
            r["predicted_step_s"] = predicted
            r["predicted_efficiency"] = t1 / (n * predicted) if mode == "strong" else t1 / predicted


def format_table(rows: list[dict], meta: dict) -> str:
    lines = [f"scaling of {meta['model']} ({rows[0]['params'] / 1e6:.2f}M parameters, {rows[0]['tensors']} tensors), "
             f"{meta['backend']}, {meta['threads']} thread(s) per rank, {meta['host_cpus']} CPUs; median of "
             f"{meta['steps']} steps after {meta['warmup']}; prediction: lockstep plan, link {meta['link']}", "",
             "| mode | N | batch/rank | step ms | samples/s | efficiency | comm share "
             "| predicted step ms | predicted efficiency |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    for r in rows:
        lines.append(f"| {r['mode']} | {r['world_size']} | {r['batch_per_rank']} | {r['step_s'] * 1e3:.2f} | "
                     f"{r['samples_per_s']:.0f} | {fmt(r['efficiency'], '.2f')} | {r['comm_share']:.1%} | "
                     f"{fmt(r['predicted_step_s'] and r['predicted_step_s'] * 1e3, '.2f')} | "
                     f"{fmt(r['predicted_efficiency'], '.2f')} |")
    shared = sorted({r["measured_as"] for r in rows if "measured_as" in r})
    if shared:
        lines.append(f"\nN=1 is measured once and used for every mode: with one rank, strong and weak scaling are "
                     f"the same run ({shared[0]})")
    for note in meta["skipped"]:
        lines.append(f"\nnot run: {note}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax_eff, ax_step = fig.subplots(1, 2)
    for mode, colour in zip(MODES, ("#4e79a7", "#f28e2b")):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        ns = [r["world_size"] for r in mine]
        ax_eff.plot(ns, [r["efficiency"] for r in mine], marker="o", color=colour, label=f"{mode}, measured")
        ax_eff.plot(ns, [r["predicted_efficiency"] for r in mine], marker="x", linestyle="--", color=colour,
                    label=f"{mode}, plan")
        ax_step.plot(ns, [r["step_s"] * 1e3 for r in mine], marker="o", color=colour, label=f"{mode}, measured")
        ax_step.plot(ns, [(r["predicted_step_s"] or 0) * 1e3 for r in mine], marker="x", linestyle="--", color=colour,
                     label=f"{mode}, plan")
    ax_eff.set_ylim(0, 1.1)
    ax_eff.set_ylabel("scaling efficiency")
    ax_step.set_ylabel("step time (ms)")
    for ax in (ax_eff, ax_step):
        ax.set_xlabel("ranks (N)")
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def world_sizes(requested: list[int], threads: int, oversubscribe: bool) -> tuple[list[int], list[str], bool, int]:
    """(sizes to run, why others are not, CUDA?, devices there are)."""
    import torch

    cuda = torch.cuda.is_available()
    capacity = torch.cuda.device_count() if cuda else max(1, (os.cpu_count() or 1) // threads)
    run, skipped = [], []
    for n in requested:
        if n <= capacity or oversubscribe:
            run.append(n)
        elif cuda:
            skipped.append(f"N={n}: this machine has {capacity} GPU(s); ranks would share a GPU")
        else:
            skipped.append(f"N={n}: {n} ranks x {threads} thread(s) need {n * threads} cores and this machine has "
                           f"{os.cpu_count()}: ranks would time-share cores and the step time would measure the "
                           "scheduler, not the scaling (--oversubscribe runs it anyway)")
    return run, skipped, cuda, capacity


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lockstep bench scaling", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--model", default="transformer",
                   help="mlp, cnn, transformer or module:factory (default transformer)")
    p.add_argument("--nproc", default=None, help="world sizes, e.g. 1,2,4 (default: 1,2,4,... up to the cores or GPUs)")
    p.add_argument("--mode", default="both", choices=[*MODES, "both"])
    p.add_argument("--batch", type=int, default=32, help="global batch (strong) and per-rank batch (weak); default 32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU); default 1")
    p.add_argument("--link", default=None, choices=sorted(LINKS),
                   help="the plan's link (default loopback on CPU, nvlink on GPU)")
    p.add_argument("--link-from", metavar="FILE",
                   help="the plan's link as a 'lockstep bench allreduce' result (its .json) measured it")
    p.add_argument("--oversubscribe", action="store_true", help="run world sizes beyond the cores / GPUs anyway")
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    for flag, ok, need in (("--steps", args.steps >= 1, ">= 1"), ("--warmup", args.warmup >= 0, ">= 0"),
                           ("--batch", args.batch >= 1, ">= 1"), ("--threads", args.threads >= 1, ">= 1"),
                           ("--timeout-s", args.timeout_s > 0, "> 0")):
        if not ok:
            p.error(f"argument {flag}: must be {need}, got {getattr(args, flag[2:].replace('-', '_'))}")
    try:
        build_model(args.model)  # fail here, with its message, not in every rank
    except ValueError as e:
        p.error(f"argument --model: {str(e).removeprefix('--model ')}")
    except Exception as e:  # the module or factory does not import or build
        p.error(f"argument --model: {args.model}: {type(e).__name__}: {e}")
    import torch

    capacity = torch.cuda.device_count() if torch.cuda.is_available() else max(1, (os.cpu_count() or 1) // args.threads)
    if args.nproc:
        try:
            requested = sorted({int(v) for v in args.nproc.split(",") if v.strip()})
        except ValueError:
            p.error(f"argument --nproc: must be a comma-separated list of integers, got {args.nproc!r}")
        if not requested or requested[0] < 1:
            p.error(f"argument --nproc: values must be >= 1, got {args.nproc!r}")
    else:
        requested = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= capacity]
    if 1 not in requested:
        requested = [1, *requested]  # efficiencies are relative to one rank
    modes = list(MODES) if args.mode == "both" else [args.mode]
    sizes, skipped, cuda, _ = world_sizes(requested, args.threads, args.oversubscribe)
    if "strong" in modes and any(args.batch % n for n in sizes):
        p.error(f"argument --batch: {args.batch} (the global batch of strong scaling) "
                f"must divide by every N in {sizes}")
    for note in skipped:
        print(f"lockstep bench scaling: not running {note}", file=sys.stderr)
    if args.link_from is not None and args.link is not None:
        p.error("argument --link-from: give --link or --link-from, not both")
    try:
        link = LINKS[args.link or ("nvlink" if cuda else "loopback")] if args.link_from is None else \
            link_from_bench(args.link_from)
    except ValueError as e:
        p.error(f"argument --link-from: {e}")
    cfg = dict(model=args.model, modes=modes, batch=args.batch, steps=args.steps, warmup=args.warmup,
               threads=args.threads, cuda=cuda, timeout_s=args.timeout_s)
    out = results_dir(p, args.out)
    rows = []
    try:
        for n in sizes:
            rows += reuse_single_rank_run(run_world(n, dict(cfg, modes=modes_to_run(n, modes))), modes)
    except RuntimeError as e:  # a rank died or timed out: spawn_and_collect names which
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    rows.sort(key=lambda r: (MODES.index(r["mode"]), r["world_size"]))
    add_efficiency_and_prediction(rows, link)
    meta = {"model": args.model, "backend": "nccl" if cuda else "gloo", "threads": args.threads,
            "host_cpus": os.cpu_count(), "steps": args.steps, "warmup": args.warmup, "link": link.name,
            "link_source": link.source, "skipped": skipped, "argv": argv,
            "torch": torch.__version__, "load_average_1_5_15": os.getloadavg()}
    table = format_table(rows, meta)
    print(table)
    if out is not None:
        name = args.model.replace(":", "_").replace(".", "_")
        stem = out / f"scaling_{name}_{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d_%H%M%S}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        stem.with_suffix(".md").write_text(f"# scaling benchmark\n\n"
                                           f"`lockstep bench scaling {' '.join(argv)}`\n\n{table}\n")
        plot(rows, stem.with_suffix(".png"), f"{args.model}: scaling efficiency and step time, measured and planned")
        print(f"\nwrote {stem}.json, .md, .png")
    return 0
