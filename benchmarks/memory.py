"""Steady-state peak memory per rank of lockstep's DDP against torch's, side by side in one run, in every mode.

Ranks on gloo (``--device cuda``: NCCL where there is a GPU per rank, else gloo with CUDA tensors). Each cell
is a fresh model, wrapped, trained 2 warm-up steps, then its peak is reset and 3 steps run:

    CPU    peak RSS (VmHWM, reset by ``echo 5 > /proc/self/clear_refs``), with ``MALLOC_MMAP_THRESHOLD_=65536``
           set for the ranks so that a freed tensor leaves RSS (glibc would keep it in its heap otherwise)
    CUDA   ``torch.cuda.max_memory_allocated`` (reset by ``reset_peak_memory_stats``)

A cell's figure is its peak minus the rank's memory just before the cell built its model (what the cell
added: parameters, gradients, buckets, activations), the larger of the ranks'; the absolute peak is beside it.

``--zero`` (issue #36): fp32 AdamW, a plain one or a ZeroRedundancyOptimizer (lockstep's / torch's, with and
without ``parameters_as_bucket_view``) on each DDP, side by side; each figure minus the activations (measured: the
bare model's forward and backward less its parameters and gradients), against lockstep's DDP with a plain AdamW.

    python benchmarks/memory.py --zero --models mlp [--world-size 2]

Cells: ``gradient_as_bucket_view`` False / True / None (lockstep only: .grad becomes the bucket slot; torch
reads None as False) x ``zero_grad()`` (set_to_none, every torch optimizer's default) / ``zero_grad(
set_to_none=False)`` x a variant: no comm hook; torch's ``allreduce_hook``; torch's ``fp16_compress_hook``
(the same function given to both DDPs); ``find_unused_parameters=True``. lockstep's cell is compared with
torch's in the same mode, lockstep's None with torch's True (None promises bucket-view memory).

    python benchmarks/memory.py [--models mlp,transformer] [--device cpu|cuda] [--variants plain,allreduce,fp16,unused]

``mlp``: 12 Linear(2048, 2048) layers, 50.3M parameters (201 MB), the issue's model (#30): large
parameters, so lockstep's default all-reduces them in place (direct buckets). ``transformer``: 12 encoder
layers of width 256, 9.7M parameters in 150 tensors (none of them 4 MB), where direct buckets do not apply.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import Transformer, run_ranks


def mlp_50m() -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(12):
        layers += [nn.Linear(2048, 2048)] + ([nn.ReLU()] if i < 11 else [])
    return nn.Sequential(*layers)


MODELS = {
    "mlp": (mlp_50m, lambda g: (torch.randn(8, 2048, generator=g), torch.randint(0, 2048, (8,), generator=g))),
    "transformer": (lambda: Transformer(vocab=1000, d_model=256, layers=12),
                    lambda g: (torch.randint(0, 1000, (2, 32), generator=g), torch.randint(0, 10, (2,), generator=g))),
}
VARIANTS = ("plain", "allreduce", "fp16", "unused")
VIEWS = (False, True, None)
WARMUP_STEPS, MEASURED_STEPS = 2, 3


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class Meter:
    """This process's memory: now, and the peak since ``reset`` (bytes)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else _rss_kb("VmRSS") * 1024

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _rss_kb("VmHWM") * 1024


def _wrap(impl: str, module: nn.Module, view, variant: str, device: torch.device):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kwargs = {"gradient_as_bucket_view": view, "find_unused_parameters": variant == "unused"}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    if impl == "torch":
        model = nn.parallel.DistributedDataParallel(module, **kwargs)
    else:
        import lockstep

        model = lockstep.DistributedDataParallel(module, **kwargs)
    if variant == "allreduce":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return model


def _release_freed() -> None:
    """The last cell's memory back to the system before this one's baseline: glibc keeps freed heap memory
    resident (a later cell would reuse it and seem to add less), ``malloc_trim`` returns it."""
    gc.collect()
    # A dropped lockstep DDP's last works (and the bucket buffers they hold) are kept 5 s for a safe exit
    # (``lockstep.ddp.lifetime``); the last cell's finished long ago, so let them go now, not inside this cell.
    from lockstep.ddp.lifetime import bury

    bury((), safe_after_s=0.0)
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def measure_cell(impl: str, build, batch, view, set_to_none: bool, variant: str, device: torch.device, meter: Meter,
                 make_optimizer=None) -> dict:
    _release_freed()
    before = meter.now()
    torch.manual_seed(0)
    model = _wrap(impl, build().to(device), view, variant, device) if impl != "none" else build().to(device)
    if make_optimizer is None:  # no optimizer state: the figures are DDP's
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    else:
        opt = make_optimizer(model if getattr(make_optimizer, "wants_model", False) else model.parameters())
    x, y = (t.to(device) for t in batch(torch.Generator().manual_seed(dist.get_rank())))
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == WARMUP_STEPS:
            meter.reset()
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    peak = meter.peak()
    del model, opt, x, y
    gc.collect()
    return {"peak_bytes": peak, "added_bytes": peak - before, "before_bytes": before}


def cells(variants) -> list[tuple[str, str, bool, object]]:
    """(variant, impl, set_to_none, view) in table order: torch and lockstep side by side."""
    out = []
    for variant in variants:
        for set_to_none in (True, False):
            for view in VIEWS:
                if view is not None:
                    out.append((variant, "torch", set_to_none, view))
                out.append((variant, "lockstep", set_to_none, view))
    return out


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # find_unused_parameters with every parameter used warns, in both DDPs
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = args.backend or ("nccl" if device.type == "cuda" and torch.cuda.device_count() >= world_size else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        meter = Meter(device)
        report = {"backend": backend, "models": {}}
        for kind in args.models:
            build, batch = MODELS[kind]
            params = list(build().parameters())
            results = {}
            for impl in ("torch", "lockstep"):  # untimed: each DDP's first cell pays one-time costs (lazy imports, gloo's buffers)
                measure_cell(impl, build, batch, False, True, "plain", device, meter)
            if args.zero:
                grad_bytes = sum(p.numel() * p.element_size() for p in params)
                report["models"][kind] = {"params": sum(p.numel() for p in params), "tensors": len(params),
                                          "grad_bytes": grad_bytes,
                                          "zero": zero_cells(build, batch, device, meter, world_size)}
                continue
            for variant, impl, set_to_none, view in cells(args.variants):
                cell = measure_cell(impl, build, batch, view, set_to_none, variant, device, meter)
                gathered: list = [None] * world_size
                dist.all_gather_object(gathered, cell)
                results[f"{variant}|{impl}|{set_to_none}|{view}"] = gathered
                if rank == 0:
                    print(f"{kind} {variant} {impl} set_to_none={set_to_none} view={view}: "
                          f"+{max(c['added_bytes'] for c in gathered) / 1e6:.0f} MB (peak {cell['peak_bytes'] / 1e6:.0f}, "
                          f"before {cell['before_bytes'] / 1e6:.0f} on rank 0)", file=sys.stderr, flush=True)
            grad_bytes = sum(p.numel() * p.element_size() for p in params)
            report["models"][kind] = {"params": sum(p.numel() for p in params), "tensors": len(params),
                                      "grad_bytes": grad_bytes, "cells": results}
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


# ---- ZeRO-1 (issue #36): optimizer state sharded, fp32 AdamW, against each DDP with a plain AdamW.
# name -> (DDP, optimizer: plain AdamW / lockstep's or torch's ZeroRedundancyOptimizer, parameters_as_bucket_view).
ZERO_CELLS = {
    "lockstep DDP + AdamW": ("lockstep", "plain", False),
    "lockstep DDP + lockstep ZeRO-1": ("lockstep", "lockstep", False),
    "lockstep DDP + lockstep ZeRO-1, bucket view": ("lockstep", "lockstep", True),
    "torch DDP + torch ZeRO-1": ("torch", "torch", False),
    "torch DDP + torch ZeRO-1, bucket view": ("torch", "torch", True),
    "torch DDP + AdamW": ("torch", "plain", False),
    "lockstep DDP + ZeRO-2 (zero_optimizer)": ("lockstep", "zero2", False),  # goal (4 + 12/N)/16 (ddp/zero2)
    "no DDP, no optimizer state (activations)": ("none", "sgd", False),
}


def _zero_optimizer(kind: str, view: bool):
    if kind == "zero2":  # ZeRO-2 is bound to the DDP: it takes the model
        def bind(model):
            return model.zero_optimizer(torch.optim.AdamW, stage=2, lr=1e-4)
        bind.wants_model = True  # type: ignore[attr-defined]
        return bind

    def make(params):
        if kind == "plain":
            return torch.optim.AdamW(params, lr=1e-4)
        if kind == "sgd":
            return torch.optim.SGD(params, lr=1e-4)
        if kind == "lockstep":
            from lockstep import ZeroRedundancyOptimizer
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer  # type: ignore[no-redef]
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=view,
                                       lr=1e-4)
    return make


def zero_cells(build, batch, device: torch.device, meter: Meter, world_size: int) -> dict:
    results = {}
    for name, (ddp, kind, view) in ZERO_CELLS.items():
        cell = measure_cell(ddp, build, batch, False, True, "plain", device, meter,
                            make_optimizer=_zero_optimizer(kind, view))
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, cell)
        results[name] = gathered
        if dist.get_rank() == 0:
            print(f"zero: {name}: +{max(c['added_bytes'] for c in gathered) / 1e6:.0f} MB", file=sys.stderr, flush=True)
    return results


def zero_markdown(report: dict, args) -> str:
    """One table per model: each cell's peak above the activations, as a ratio to lockstep's DDP + AdamW and as
    bytes a parameter, against the goal (8 + 8/N)/16 and torch's ZeroRedundancyOptimizer on torch's DDP."""
    n = args.world_size
    goal = (8 + 8 / n) / 16
    lines = [f"# ZeRO-1 memory, {n} ranks, {report['backend']} on {args.device}, torch {torch.__version__}, fp32 AdamW "
             f"({datetime.datetime.now():%Y-%m-%d %H:%M})", "",
             f"Peak per rank over steps {WARMUP_STEPS + 1}-{WARMUP_STEPS + MEASURED_STEPS} (the larger rank's), minus "
             "the rank's memory before the cell built its model, minus the activations (the last row's figure less its "
             "parameters and gradients); MB. Goal: lockstep's ZeRO-1 <= (8 + 8/N)/16 = "
             f"{goal:.3f} of lockstep's DDP + AdamW, and below torch's ZeroRedundancyOptimizer on torch's DDP.", ""]
    for kind, r in report["models"].items():
        cells_ = r["zero"]
        param_bytes = r["grad_bytes"]  # fp32: parameters and gradients are the same size
        activations = _mb(cells_["no DDP, no optimizer state (activations)"]) - 2 * param_bytes / 1e6
        base = _mb(cells_["lockstep DDP + AdamW"]) - activations
        lines += [f"## {kind}: {r['params'] / 1e6:.1f}M parameters, {param_bytes / 1e6:.0f} MB in fp32; activations "
                  f"{activations:.1f} MB", "",
                  "| cell | MB above activations | / lockstep DDP + AdamW | bytes a parameter |", "|---|---|---|---|"]
        for name in ZERO_CELLS:
            if name.startswith("no DDP") or name not in cells_:
                continue
            mb = _mb(cells_[name]) - activations
            lines.append(f"| {name} | {mb:.0f} | {mb / base:.3f} | {mb * 1e6 / r['params']:.1f} |")
        ours = min(_mb(cells_[c]) for c in ZERO_CELLS if c.startswith("lockstep DDP + lockstep ZeRO-1")) - activations
        torch_zero = min(_mb(cells_[c]) for c in ZERO_CELLS if c.startswith("torch DDP + torch ZeRO-1")) - activations
        default = _mb(cells_["lockstep DDP + lockstep ZeRO-1"]) - activations
        lines += ["", "lockstep's ZeRO-1 (default, parameters_as_bucket_view=False): "
                  f"{default / base:.3f} of lockstep's "
                  f"DDP + AdamW (goal <= {goal:.3f}: {'met' if default / base <= goal else 'NOT met'}); best of "
                  f"lockstep's cells {ours:.0f} MB against torch's best {torch_zero:.0f} MB "
                  f"({'below' if ours < torch_zero else 'NOT below'}).", ""]
        zero2 = "lockstep DDP + ZeRO-2 (zero_optimizer)"
        if zero2 in cells_:
            ratio, goal2 = (_mb(cells_[zero2]) - activations) / base, (4 + 12 / n) / 16
            lines += [f"ZeRO-2: {ratio:.3f} of lockstep's DDP + AdamW (goal <= (4 + 12/N)/16 = {goal2:.3f}: "
                      f"{'met' if ratio <= goal2 else 'NOT met'}).", ""]
    return "\n".join(lines)


def _mb(cell: list[dict], key: str = "added_bytes") -> float:
    return max(c[key] for c in cell) / 1e6


def markdown(report: dict, args, title: str = "") -> tuple[str, list[str]]:
    """The tables, and the cells where lockstep holds more than torch (its None: more than torch's True)."""
    what = "peak RSS (VmHWM)" if args.device == "cpu" else "torch.cuda.max_memory_allocated"
    lines = [(f"# DDP memory, {args.world_size} ranks, {report['backend']} on {args.device}, torch {torch.__version__} "
             f"({datetime.datetime.now():%Y-%m-%d %H:%M}){title}"), "",
             f"Steady-state {what} over steps {WARMUP_STEPS + 1}-{WARMUP_STEPS + MEASURED_STEPS} of a fresh model per "
             "cell, minus the rank's memory before the cell built it (the larger rank's), in MB; the absolute peak in "
             "brackets. lockstep's None is compared with torch's True. `zero_grad()` = set_to_none (torch's default)."
             + (" `MALLOC_MMAP_THRESHOLD_=65536`." if args.device == "cpu" else ""), ""]
    worse = []
    for kind, r in report["models"].items():
        grad_mb = r["grad_bytes"] / 1e6
        lines += [f"## {kind}: {r['params'] / 1e6:.1f}M parameters in {r['tensors']} tensors, {grad_mb:.0f} MB of gradients", "",
                  "| variant | zero_grad | gradient_as_bucket_view | torch MB | lockstep MB | lockstep / torch | lockstep - torch (models' gradients) |",
                  "|---|---|---|---|---|---|---|"]
        cells_ = r["cells"]
        for variant, impl, set_to_none, view in cells(args.variants):
            if impl != "lockstep":
                continue
            mine = cells_[f"{variant}|lockstep|{set_to_none}|{view}"]
            theirs = cells_[f"{variant}|torch|{set_to_none}|{True if view is None else view}"]
            a, b = _mb(mine), _mb(theirs)
            flag = ""
            if a > b + 0.02 * grad_mb:  # more than 2% of one model's gradients above: a real difference, not RSS noise
                flag = " **more**"
                worse.append(f"{kind} {variant} zero_grad(set_to_none={set_to_none}) view={view}: {a:.0f} > {b:.0f} MB")
            zg = "`zero_grad()`" if set_to_none else "`set_to_none=False`"
            torch_view = "True (for None)" if view is None else str(view)
            lines.append(f"| {variant} | {zg} | {view} vs torch {torch_view} | {b:.0f} [{_mb(theirs, 'peak_bytes'):.0f}] | "
                         f"{a:.0f} [{_mb(mine, 'peak_bytes'):.0f}] | {a / b:.3f}{flag} | {(a - b) / grad_mb:+.2f} |")
        default = {stn: _mb(cells_[f"plain|lockstep|{stn}|False"]) for stn in (True, False)} if "plain" in args.variants else {}
        if default:
            lines += ["", ("lockstep's bucket-view modes against its default (copies), no hook, in models' gradients "
                      "(negative: less):"), ""]
            for stn in (True, False):
                for view in (True, None):
                    delta = (_mb(cells_[f"plain|lockstep|{stn}|{view}"]) - default[stn]) / grad_mb
                    lines.append(f"- zero_grad(set_to_none={stn}), gradient_as_bucket_view={view}: {delta:+.2f}")
        lines.append("")
    lines.append("Cells where lockstep holds more than torch: " + ("; ".join(worse) if worse else "none."))
    return "\n".join(lines), worse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer", help=f"from {','.join(MODELS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {','.join(VARIANTS)}")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="", help="default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--zero", action="store_true",
                        help="ZeRO-1 instead: fp32 AdamW, plain or lockstep's / torch's ZeroRedundancyOptimizer, "
                             "on each DDP")
    parser.add_argument("--title", default="", help="appended to the table's title (e.g. ', before the fix')")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="'' to write nothing")
    args = parser.parse_args(argv)
    args.models, args.variants = args.models.split(","), args.variants.split(",")
    for flag, names, known in (("--models", args.models, MODELS), ("--variants", args.variants, VARIANTS)):
        for name in names:
            if name not in known:
                parser.error(f"{flag}: unknown name {name!r}; choose from {list(known)}")
    if args.world_size < 2 or args.threads < 1:
        parser.error("--world-size must be >= 2 and --threads >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at the ranks' start (spawned: they inherit it)
    report = run_ranks(_worker, args.world_size, args)
    if report is None:
        return 1
    text = zero_markdown(report, args) if args.zero else markdown(report, args, args.title)[0]
    print(text)
    if args.out:
        from ddp_step import write_results

        kind = "memory_zero" if args.zero else "memory"
        stem = f"{kind}_{datetime.datetime.now():%Y-%m-%d_%H%M%S}_n{args.world_size}_{args.device}"
        write_results(args.out, stem, text, {"args": {k: v for k, v in vars(args).items() if k != "out"},
                                             "torch": torch.__version__, "results": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
