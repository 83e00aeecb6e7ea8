"""Step time of lockstep's DDP against torch's C++ DDP, side by side in one run, with the floor no DDP can beat.

Ranks on gloo, ``--threads`` intra-op threads each. Contenders (``--contenders``, all by default):

    compute        the module alone, no DDP: the compute-alone floor (forward, backward, SGD step)
    floor          the module alone plus, after its backward, one blocking all-reduce of a flat buffer as large
                   as its gradients (no hooks, no copies): compute + all-reduce, paid in the same step, so with
                   the slower rank's compute (skew) in it. What a DDP that cannot overlap (no spare core) and
                   copied nothing would take
    torch          torch's DDP with its defaults (25 MB buckets)
    torch_fp16     torch's DDP with torch's fp16_compress_hook
    lockstep_25    lockstep's DDP, fixed 25 MB cap (its default)
    lockstep_auto  lockstep's DDP, bucket_cap_mb="auto" (tuned alone before the timed steps)
    lockstep_fp16  lockstep's DDP with lockstep.comm_hooks.fp16_compress_hook
    naive          lockstep's naive reducer (one blocking all-reduce per parameter), off by default
    lockstep_alias lockstep's DDP with gradient_as_bucket_view=None (.grad lives in the buckets, no copy
                   back), off by default: beside lockstep_25 (copies, the default) it shows what that saves
    lockstep_nonfinite  lockstep_25 with detect_nonfinite=True, off by default: the NaN check's cost, paired
    lockstep_nodirect   lockstep_25 without direct buckets (every gradient copied in and back, as torch's),
                   off by default: what direct buckets save
    lockstep_fp16_called  lockstep's DDP with chain(fp16_compress, allreduce_hook): lockstep_fp16's arithmetic,
                   not declared, so the hook is called instead of run by the reducer (``ddp/fused_compress``),
                   off by default: beside lockstep_fp16 it shows what the fused path saves
    lockstep_zero2 lockstep's DDP with ``zero_optimizer(SGD, stage=2)``: buckets reduce-scattered, each rank stepping
                   its shard, parameters all-gathered per bucket (``ddp/zero2``), off by default: beside lockstep_25
                   (issue #36's goal: <= 1.05 x); its all-gathers are waited for inside its timed step
    lockstep_zero2_pair  the same, timed over two steps back to back (the second forward waits per module for the
                   first step's all-gathers, as in a training loop), then the wait for the second's: per step, off by
                   default
    lockstep_zero2_ar, lockstep_zero2_ring (and their _pair)  lockstep_zero2 with LOCKSTEP_ZERO_COLLECTIVES=
                   all_reduce (gloo's all-reduce pair: twice DDP's bytes) or =ring (the ring's halves over send/recv
                   on a thread of their own: DDP's bytes), whatever the default is; off by default

Every iteration runs one training step of each contender, in a rotating order (none always
goes first), each after a barrier; rank 0's wall time per step is recorded. Timed iterations
are cut into ``--blocks`` blocks: a contender's figure is the median of its per-block medians,
and a ratio is the median over blocks of the per-block ratio (paired in time, so slow drift of
a shared machine's load cancels), with the blocks' range beside it. Also timed, alone: the
all-reduce of the model's gradients (one flat buffer, and 25 MB chunks in flight together),
the all-reduce-alone floor.

    python benchmarks/ddp_step.py [--models mlp,cnn,transformer] [--threads 1] [--blocks 5] [--block-steps 8]

``--compile inductor`` compiles every module before wrapping it (``DDP(torch.compile(m))``, nanoGPT's order):
both DDPs then get dynamo's graph split at their buckets (``lockstep.ddp.compiled``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue as queue_mod
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def mlp_10m() -> nn.Module:
    # 1024*2048 + 2*2048*2048 + 2048*10 (+ biases) = 10.5M parameters, 42 MB of fp32 gradients.
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )


def cnn() -> nn.Module:
    """A small VGG-like CNN with BatchNorm: 20 parameter tensors, ~1.2M parameters (buffers broadcast each step)."""
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128), *block(128, 128), nn.MaxPool2d(2),
        *block(128, 256), *block(256, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )


class Transformer(nn.Module):
    """Embedding + 4 encoder layers + head: 52 parameter tensors, ~2.2M parameters."""

    def __init__(self, vocab: int = 1000, d_model: int = 192, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


MODELS = {
    "mlp": (mlp_10m, lambda g: (torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g))),
    "cnn": (cnn, lambda g: (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))),
    "transformer": (Transformer, lambda g: (torch.randint(0, 1000, (16, 32), generator=g), torch.randint(0, 10, (16,), generator=g))),
}
CONTENDERS = ("compute", "torch", "torch_fp16", "lockstep_25", "lockstep_auto", "lockstep_fp16", "naive", "lockstep_alias",
              "lockstep_nonfinite", "lockstep_nodirect", "lockstep_fp16_called", "lockstep_zero2",
              "lockstep_zero2_pair", "lockstep_zero2_ar", "lockstep_zero2_ring", "lockstep_zero2_ar_pair",
              "lockstep_zero2_ring_pair", "floor")
DEFAULT_CONTENDERS = CONTENDERS[:6] + ("floor",)
# (numerator, denominator) pairs reported; the targets are auto and 25 MB vs torch, fp16 vs torch's fp16.
RATIOS = (("lockstep_25", "torch"), ("lockstep_auto", "torch"), ("lockstep_fp16", "torch_fp16"), ("torch", "compute"),
          ("lockstep_alias", "torch"), ("lockstep_alias", "lockstep_25"), ("lockstep_nonfinite", "lockstep_25"),
          ("lockstep_nodirect", "torch"), ("lockstep_25", "lockstep_nodirect"), ("floor", "torch"), ("lockstep_auto", "floor"),
          ("lockstep_25", "floor"), ("lockstep_fp16_called", "torch_fp16"), ("lockstep_fp16", "lockstep_fp16_called"),
          ("lockstep_zero2", "lockstep_25"), ("lockstep_zero2", "torch"), ("lockstep_zero2_pair", "lockstep_25"),
          ("lockstep_zero2_ring", "lockstep_zero2_ar"), ("lockstep_zero2_ring_pair", "lockstep_zero2_ar_pair"),
          ("lockstep_zero2_ring", "lockstep_25"), ("lockstep_zero2_ar", "lockstep_25"))
# The ZeRO-2 contenders that choose their collectives (read at zero_optimizer's binding); the rest take the default.
ZERO2_COLLECTIVES = {"lockstep_zero2_ar": "all_reduce", "lockstep_zero2_ring": "ring",
                     "lockstep_zero2_ar_pair": "all_reduce", "lockstep_zero2_ring_pair": "ring"}


def _build(name: str, build, compile_backend: str = ""):
    import lockstep
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    module = build()
    if compile_backend:  # nanoGPT's order: compiled, then wrapped (every contender alike)
        module = torch.compile(module, backend=compile_backend)
    if name == "compute":
        return module
    if name == "floor":
        return _Floor(module)
    if name.startswith("torch"):
        model = nn.parallel.DistributedDataParallel(module)
        if name == "torch_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return model
    if name == "naive":
        return lockstep.NaiveDistributedDataParallel(module)
    view = None if name == "lockstep_alias" else False  # None: .grad in the buckets; False: the default, copies
    cls = lockstep.DistributedDataParallel
    if name == "lockstep_nodirect":
        class NoDirect(lockstep.DistributedDataParallel):  # every bucket copies, as torch's
            direct_min_bytes = None
        cls = NoDirect
    model = cls(module, bucket_cap_mb="auto" if name == "lockstep_auto" else None, gradient_as_bucket_view=view,
                detect_nonfinite=name == "lockstep_nonfinite")
    if name == "lockstep_fp16":
        model.register_comm_hook(None, lockstep.comm_hooks.fp16_compress_hook)
    if name == "lockstep_fp16_called":
        hooks = lockstep.comm_hooks
        model.register_comm_hook(None, hooks.chain(hooks.fp16_compress, hooks.allreduce_hook))
    return model


class _Floor(nn.Module):
    """The module, and a flat buffer of its gradients' size all-reduced after each backward (``floor``)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.flat = torch.zeros(sum(p.numel() for p in module.parameters()))

    def forward(self, *args):
        return self.module(*args)


def _optimizer(name: str, model):
    """SGD with momentum; ZeRO-2's over the shards for a zero2 contender, with its collectives where it names them."""
    if "zero2" not in name:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if name in ZERO2_COLLECTIVES:
        os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = ZERO2_COLLECTIVES[name]
    try:
        return model.zero_optimizer(torch.optim.SGD, stage=2, lr=1e-3, momentum=0.9)
    finally:
        os.environ.pop("LOCKSTEP_ZERO_COLLECTIVES", None)


def _step(model, opt, x, y, finish: bool = True) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if isinstance(model, _Floor):
        dist.all_reduce(model.flat)
    opt.step()
    if finish and getattr(getattr(model, "reducer", None), "zero", None) is not None:
        # ZeRO-2's all-gathers, waited for within its own step: the next forward of this model comes only after the
        # other contenders' steps here, which would hide them whole (in a real loop they overlap that forward)
        model.finish_step()


def _allreduce_alone(numel: int, reps: int) -> dict[str, float]:
    """Median seconds to all-reduce ``numel`` fp32 values: one buffer, and 25 MB chunks all in flight."""
    flat = torch.randn(numel)
    chunk = 25 * 1024 * 1024 // 4
    out: dict[str, list[float]] = {"one_buffer_ms": [], "chunks_25mb_ms": []}
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        out["one_buffer_ms"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(piece, async_op=True) for piece in flat.split(chunk)]
        for work in works:
            work.wait()
        out["chunks_25mb_ms"].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def _summarise(times: dict[str, list[float]], blocks: int, ratios_of=RATIOS) -> dict:
    """Median of per-block medians per contender; per-block paired ratios (median, min, max) of ``ratios_of``'s pairs."""
    per_block = {}
    for name, t in times.items():
        size = len(t) // blocks
        per_block[name] = [statistics.median(t[b * size : (b + 1) * size]) for b in range(blocks)]
    medians = {name: statistics.median(v) * 1e3 for name, v in per_block.items()}
    ratios = {}
    for num, den in ratios_of:
        if num in per_block and den in per_block:
            r = [a / b for a, b in zip(per_block[num], per_block[den])]
            ratios[f"{num}/{den}"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
    return {"median_ms": medians, "block_medians_ms": {k: [x * 1e3 for x in v] for k, v in per_block.items()},
            "ratios": ratios}


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    if args.compile:  # one compiled forward per contender and model: more than dynamo's default 8 recompiles
        from torch._dynamo import config as dynamo_config

        dynamo_config.cache_size_limit = 64
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        report = {}
        for kind in args.models:
            build, batch = MODELS[kind]
            models = {name: _build(name, build, args.compile) for name in args.contenders}
            optims = {name: _optimizer(name, m) for name, m in models.items()}
            x, y = batch(torch.Generator().manual_seed(rank))
            auto = models.get("lockstep_auto")
            if auto is not None:  # its trials, alone; the schedule counts steps, so every rank runs as many
                while not auto.reducer.tuner.done:  # the forward after the last trial step decides
                    _step(auto, optims["lockstep_auto"], x, y)
            times: dict[str, list[float]] = {name: [] for name in models}
            cpu_times: dict[str, list[float]] = {name: [] for name in models}  # this process, gloo's threads included
            names = list(models)
            total = args.warmup + args.blocks * args.block_steps
            for it in range(total):
                shift = it % len(names)
                for name in names[shift:] + names[:shift]:
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    pair = "zero2" in name and name.endswith("_pair")  # two steps, the first's all-gathers under the second's forward
                    if pair:
                        _step(models[name], optims[name], x, y, finish=False)
                    _step(models[name], optims[name], x, y)
                    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                    if pair:
                        elapsed, cpu = elapsed / 2, cpu / 2
                    if it >= args.warmup:
                        times[name].append(elapsed)
                        cpu_times[name].append(cpu)
            summary = _summarise(times, args.blocks)
            # CPU time per step, paired the same way: it leaves out the time a rank waits for its peer (skew, a
            # neighbour on a shared machine), so it is steadier than wall time; it is not what the user waits for.
            cpu_summary = _summarise(cpu_times, args.blocks)
            summary.update(cpu_median_ms=cpu_summary["median_ms"], cpu_ratios=cpu_summary["ratios"])
            params = list(build().parameters())
            numel = sum(p.numel() for p in params)
            summary.update(params=numel, tensors=len(params), allreduce_alone=_allreduce_alone(numel, args.allreduce_reps))
            if auto is not None:
                summary["auto"] = auto.reducer.tuner.result
            report[kind] = summary
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


def _markdown(report: dict, args, load: tuple[float, ...]) -> str:
    lines = [
        f"# DDP step time, {args.world_size} ranks x {args.threads} thread(s), gloo, torch {torch.__version__} "
        f"({datetime.datetime.now():%Y-%m-%d %H:%M})" + (f", modules torch.compile'd ({args.compile})" if args.compile else ""),
        "",
        f"{args.blocks} blocks of {args.block_steps} interleaved steps after {args.warmup} warm-up; load average "
        f"before: {' / '.join(f'{v:.2f}' for v in load)}. Step ms = median of block medians; ratio = median of "
        "per-block ratios [min-max over blocks].",
        "",
    ]
    names = [c for c in CONTENDERS if any(c in r["median_ms"] for r in report.values())]
    lines += ["| model | params | tensors | " + " | ".join(f"{n} ms" for n in names) + " | all-reduce alone ms (1 buffer / 25 MB chunks) |",
              "|---|---|---|" + "---|" * len(names) + "---|"]
    for kind, r in report.items():
        cells = " | ".join(f"{r['median_ms'][n]:.1f}" if n in r["median_ms"] else "-" for n in names)
        ar = r["allreduce_alone"]
        lines.append(f"| {kind} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {cells} | "
                     f"{ar['one_buffer_ms']:.1f} / {ar['chunks_25mb_ms']:.1f} |")
    ratio_names = sorted({k for r in report.values() for k in r["ratios"]}, key=[f"{a}/{b}" for a, b in RATIOS].index)
    lines += ["", "| model | " + " | ".join(ratio_names) + " | auto chose |", "|---|" + "---|" * len(ratio_names) + "---|"]
    for kind, r in report.items():
        cells = " | ".join(
            f"{r['ratios'][k]['median']:.3f} [{r['ratios'][k]['min']:.3f}-{r['ratios'][k]['max']:.3f}]" if k in r["ratios"] else "-"
            for k in ratio_names
        )
        auto = r.get("auto") or {}
        chose = "-" if "chosen_mb" not in auto else ("one bucket" if auto["chosen_mb"] is None else f"{auto['chosen_mb']:g} MB")
        lines.append(f"| {kind} | {cells} | {chose} |")
    if any(r.get("cpu_ratios") for r in report.values()):
        lines += ["", "CPU time per step of rank 0's process (gloo's threads included; waiting for the peer left out), the same",
                  "pairing: steadier than wall time on a shared machine.", "",
                  "| model | " + " | ".join(ratio_names) + " |", "|---|" + "---|" * len(ratio_names)]
        for kind, r in report.items():
            cpu = r.get("cpu_ratios", {})
            lines.append(f"| {kind} | " + " | ".join(
                f"{cpu[k]['median']:.3f} [{cpu[k]['min']:.3f}-{cpu[k]['max']:.3f}]" if k in cpu else "-" for k in ratio_names) + " |")
    lines += ["", "The floor: a DDP step cannot beat `compute`; with nothing to overlap on (1 thread per rank, no spare",
              "core) it tends to compute + the part of the all-reduce that backward cannot hide. `floor`, where run,",
              "is that step measured: compute, then one all-reduce of the gradients' bytes, no copies, no hooks."]
    return "\n".join(lines)


def split_choices(parser, args, models, contenders) -> None:
    """``--models`` and ``--contenders`` from comma lists to lists, each name checked (exit 2 naming it)."""
    args.models, args.contenders = args.models.split(","), args.contenders.split(",")
    for flag, names, known in (("--models", args.models, list(models)), ("--contenders", args.contenders, list(contenders))):
        for name in names:
            if name not in known:
                parser.error(f"{flag}: unknown {flag[2:-1]} {name!r}; choose from {known}")


def run_ranks(worker, world_size: int, args) -> dict | None:
    """Spawn ``worker(rank, world_size, port, args, queue)`` on each rank; rank 0's report, or None (said on
    stderr) as soon as a rank dies (out of memory, a CUDA error) instead of waiting out the queue."""
    from lockstep.process_group import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    report = None
    while report is None:
        try:
            report = queue.get(timeout=2)
        except queue_mod.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                print(f"{os.path.basename(sys.argv[0])}: rank(s) {dead} (rank, exit code) died; see their output above",
                      file=sys.stderr)
                return None
    for p in procs:
        p.join()
    return report


def write_results(out_dir: str, stem: str, text: str, record: dict) -> None:
    """``<out_dir>/<stem>.md`` (the tables) and ``.json`` (everything measured)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(record, f, indent=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help=f"from {','.join(CONTENDERS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--block-steps", type=int, default=8, help="interleaved iterations per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--allreduce-reps", type=int, default=10)
    parser.add_argument("--compile", default="", metavar="BACKEND",
                        help="torch.compile every module with this backend (inductor, aot_eager) before wrapping")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="'' to write nothing")
    args = parser.parse_args(argv)
    split_choices(parser, args, MODELS, CONTENDERS)
    if args.threads < 1 or args.world_size < 2 or args.blocks < 1 or args.block_steps < 1:
        parser.error("--threads and --blocks and --block-steps must be >= 1, --world-size >= 2")
    if args.blocks * args.block_steps < 20:
        print("note: fewer than 20 timed steps per contender; medians will be noisy", file=sys.stderr)
    load = os.getloadavg()
    report = run_ranks(_worker, args.world_size, args)
    if report is None:
        return 1
    text = _markdown(report, args, load)
    print(text)
    if args.out:
        stem = f"ddp_step_{datetime.datetime.now():%Y-%m-%d_%H%M%S}_n{args.world_size}_t{args.threads}"
        stem += f"_compile-{args.compile}" if args.compile else ""
        write_results(args.out, stem, text, {"args": {k: v for k, v in vars(args).items() if k != "out"},
                                             "torch": torch.__version__, "load_average_1_5_15": load, "results": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
