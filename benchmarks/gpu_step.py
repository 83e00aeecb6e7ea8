"""Step time of lockstep's DDP against torch's on GPUs (NCCL), interleaved in one run (issue #13, GPU part).

One rank per GPU (``--world-size 1`` by default: a one-GPU machine, where DDP's cost is its own work:
copies, hooks, the all-reduce of a single rank), bf16 autocast, AdamW (fused on CUDA). Models:

    gpt       GPT-2 small's shape: 12 layers, d_model 768, vocab 50304, context 1024; 124M parameters in
              148 tensors (the token embedding tied to the head), batch 8 x 1024 tokens
    resnet50  ResNet-50 (bottleneck blocks 3-4-6-3, BatchNorm): 25.6M parameters in 161 tensors, batch 64
              of 224 x 224 images

Contenders (``--contenders``; the first five by default):

    compute         the module alone, no DDP
    torch           torch's DDP, defaults (gradient_as_bucket_view=False: gradients copied in and back)
    torch_view      torch's DDP, gradient_as_bucket_view=True
    lockstep        lockstep's DDP, defaults
    lockstep_view   lockstep's DDP, gradient_as_bucket_view=True
    lockstep_alias  lockstep's DDP, gradient_as_bucket_view=None (``.grad`` is its bucket slot)
    lockstep_auto   lockstep's DDP, bucket_cap_mb="auto" (its trials run alone before the timed steps)

Every iteration runs one step of each contender in a rotating order; a step is timed on the host from a
synchronised GPU to a synchronised GPU (zero_grad, forward and loss under autocast, backward, optimizer
step): what the user waits for. Timed iterations are cut into ``--blocks`` blocks; a contender's figure
is the median of its block medians, a ratio the median of the per-block ratios (paired in time), with
the blocks' range (as ``ddp_step.py``).

    python benchmarks/gpu_step.py [--models gpt,resnet50] [--world-size 1] [--blocks 8] [--block-steps 5]

``--device cpu --tiny``: the same code on CPU (gloo) with tiny shapes: the suite's check that this script
runs where no GPU is; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import _summarise, run_ranks, split_choices, write_results  # noqa: E402  (block medians, paired ratios, spawning)


class _Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        batch, seq, d_model = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(d_model, 2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only transformer, GPT-2 small's shape by default; the token embedding is the head's weight."""

    def __init__(self, vocab: int = 50304, context: int = 1024, d_model: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens):
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


class _Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out),
        )
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return F.relu(self.body(x) + (x if self.down is None else self.down(x)))


def resnet50(classes: int = 1000, base: int = 64) -> nn.Module:
    """ResNet-50's layout (torchvision's, written out: no torchvision needed): 161 parameter tensors."""
    layers: list[nn.Module] = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    c_in = base
    for stage, blocks in enumerate((3, 4, 6, 3)):
        width = base << stage
        for b in range(blocks):
            layers.append(_Bottleneck(c_in, width, 2 if stage and b == 0 else 1))
            c_in = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


def _models(tiny: bool) -> dict:
    """name -> (build, batch(generator, device) -> (input, target), loss(output, target))."""
    def lm_loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def class_loss(logits, target):
        return F.cross_entropy(logits.float(), target)

    if tiny:
        gpt = (lambda: GPT(vocab=256, context=32, d_model=32, layers=2, heads=2), (2, 32, 256))
        res = (lambda: resnet50(classes=10, base=4), (4, 32, 10))
    else:
        gpt = (GPT, (8, 1024, 50304))
        res = (resnet50, (64, 224, 1000))
    (gpt_build, (b, seq, vocab)), (res_build, (n, side, classes)) = gpt, res

    def gpt_batch(g, device):
        tokens = torch.randint(0, vocab, (b, seq + 1), generator=g)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def res_batch(g, device):
        return torch.randn(n, 3, side, side, generator=g).to(device), torch.randint(0, classes, (n,), generator=g).to(device)

    return {"gpt": (gpt_build, gpt_batch, lm_loss), "resnet50": (res_build, res_batch, class_loss)}


CONTENDERS = ("compute", "torch", "torch_view", "lockstep", "lockstep_view", "lockstep_alias", "lockstep_auto")
DEFAULT_CONTENDERS = CONTENDERS[:5]
RATIOS = (("lockstep", "torch"), ("lockstep_view", "torch_view"), ("lockstep_alias", "torch"), ("lockstep_auto", "torch"),
          ("torch", "compute"), ("lockstep", "compute"), ("torch_view", "torch"), ("lockstep_view", "lockstep"))
VIEW = {"torch": False, "torch_view": True, "lockstep": False, "lockstep_view": True, "lockstep_alias": None, "lockstep_auto": False}


def _build(name: str, build, device: torch.device) -> nn.Module:
    import lockstep

    torch.manual_seed(0)
    module = build().to(device)
    if name == "compute":
        return module
    ids = [device.index] if device.type == "cuda" else None
    if name.startswith("torch"):
        return nn.parallel.DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=VIEW[name])
    return lockstep.DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=VIEW[name],
                                            bucket_cap_mb="auto" if name == "lockstep_auto" else None)


def _step(model, opt, x, y, loss_fn, device_type: str) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        report = {}
        for kind in args.models:
            build, batch, loss_fn = _models(args.tiny)[kind]
            models = {name: _build(name, build, device) for name in args.contenders}
            optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=cuda or None) for name, m in models.items()}
            x, y = batch(torch.Generator().manual_seed(rank), device)
            auto = models.get("lockstep_auto")
            if auto is not None:  # its trials, alone (every rank runs as many steps)
                while not auto.reducer.tuner.done:
                    _step(auto, optims["lockstep_auto"], x, y, loss_fn, device.type)
            times: dict[str, list[float]] = {name: [] for name in models}
            names = list(models)
            for it in range(args.warmup + args.blocks * args.block_steps):
                shift = it % len(names)
                for name in names[shift:] + names[:shift]:
                    sync()
                    if world_size > 1:
                        dist.barrier()
                        sync()
                    start = time.perf_counter()
                    _step(models[name], optims[name], x, y, loss_fn, device.type)
                    sync()
                    if it >= args.warmup:
                        times[name].append(time.perf_counter() - start)
            summary = _summarise(times, args.blocks, RATIOS)
            params = list(build().parameters())
            summary.update(params=sum(p.numel() for p in params), tensors=len(params))
            if auto is not None:
                summary["auto"] = auto.reducer.tuner.result
            if cuda:
                summary["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            del models, optims
            if cuda:
                torch.cuda.empty_cache()
            report[kind] = summary
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


def _markdown(report: dict, args, device_name: str) -> str:
    lines = [
        f"# DDP step time on {device_name}, world size {args.world_size}, "
        f"{'NCCL' if args.device == 'cuda' else 'gloo'}, bf16 autocast, torch {torch.__version__} "
        f"({datetime.datetime.now():%Y-%m-%d %H:%M})" + (" (tiny shapes: a smoke run, not figures)" if args.tiny else ""),
        "",
        f"{args.blocks} blocks of {args.block_steps} interleaved steps after {args.warmup} warm-up. Step ms = median "
        "of block medians; ratio = median of per-block ratios [min-max over blocks].",
        "",
    ]
    names = [c for c in CONTENDERS if any(c in r["median_ms"] for r in report.values())]
    lines += ["| model | params | tensors | " + " | ".join(f"{n} ms" for n in names) + " |",
              "|---|---|---|" + "---|" * len(names)]
    for kind, r in report.items():
        cells = " | ".join(f"{r['median_ms'][n]:.2f}" if n in r["median_ms"] else "-" for n in names)
        lines.append(f"| {kind} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {cells} |")
    ratio_names = [f"{a}/{b}" for a, b in RATIOS if any(f"{a}/{b}" in r["ratios"] for r in report.values())]
    lines += ["", "| model | " + " | ".join(ratio_names) + " |", "|---|" + "---|" * len(ratio_names)]
    for kind, r in report.items():
        cells = " | ".join(
            f"{r['ratios'][k]['median']:.3f} [{r['ratios'][k]['min']:.3f}-{r['ratios'][k]['max']:.3f}]" if k in r["ratios"] else "-"
            for k in ratio_names)
        lines.append(f"| {kind} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,resnet50")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help=f"from {','.join(CONTENDERS)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks, one GPU each")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (--device cpu)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=5, help="interleaved iterations per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="'' to write nothing")
    args = parser.parse_args(argv)
    split_choices(parser, args, _models(True), CONTENDERS)
    if args.world_size < 1 or args.blocks < 1 or args.block_steps < 1 or args.threads < 1:
        parser.error("--world-size, --threads, --blocks and --block-steps must be >= 1")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no GPU here (torch.cuda.is_available() is False); --device cpu --tiny runs on CPU")
        if args.world_size > torch.cuda.device_count():
            parser.error(f"--world-size {args.world_size}: one GPU per rank, and {torch.cuda.device_count()} are here")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    report = run_ranks(_worker, args.world_size, args)
    if report is None:
        return 1
    text = _markdown(report, args, device_name)
    print(text)
    if args.out:
        tag = "".join(c if c.isalnum() else "-" for c in device_name.replace("NVIDIA ", "")).strip("-").lower()
        stem = f"gpu_step_{datetime.datetime.now():%Y-%m-%d_%H%M%S}_{tag}_n{args.world_size}" + ("_tiny" if args.tiny else "")
        write_results(args.out, stem, text, {"args": {k: v for k, v in vars(args).items() if k != "out"},
                                             "torch": torch.__version__, "device": device_name, "results": report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
