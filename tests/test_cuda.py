"""lockstep's DDP on CUDA (issue #13's GPU part): skipped where no GPU is; the sessions lent one run it.

Two groups where a GPU is: world size 1 on NCCL, and 2 ranks sharing the one GPU on gloo (its CUDA
all-reduce stages through the host; NCCL will not put two ranks on one device). Each runs ``_cases``:

- parity: lockstep's DDP against torch's, bit for bit, under bf16 autocast, with gradients copied
  (the default), as bucket views, aliased (``None``, lockstep's), with ``bucket_cap_mb="auto"``'s trials
  and with the fp16 hook; at 2 ranks
  also against one process averaging the two half-batches' gradients (a/2 + b/2, exact in fp32);
- a BatchNorm model (buffers broadcast at every forward at 2 ranks);
- the missing-gradient error, which on CUDA comes one backward late (``MissingFlag``: no ``.item()`` on
  the step's path) and names the parameters on every rank;
- a forward, backward and step on a side stream (torch's test_DistributedDataParallel_non_default_stream);
- the Trainer's crash and exact resume (dropout on the device: the checkpoint carries the CUDA RNG state);
- NCCL only: no host sync in steady-state steps, checked with ``torch.cuda.set_sync_debug_mode("error")``
  (a sync raises), for copies, bucket views and the fp16 hook, torch's DDP measured the same way beside.

Deterministic algorithms are asked for (cuDNN's and the embedding's backward otherwise add in any order).
``test_cases_on_cpu`` runs the same cases on CPU (gloo, 2 ranks; the CUDA-only ones report skipped)
so that this file cannot rot where no GPU is.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks
from models import Branchy, build, make_batch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no GPU here (torch.cuda.is_available() is False)")
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
STEPS = 6
PER_RANK = 8


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))

    def forward(self, x):
        return self.net(x)


def _model(kind: str, seed: int, device) -> nn.Module:
    if kind == "bn":
        torch.manual_seed(seed)
        return BatchNormNet().to(device)
    return build(kind, seed).to(device)


def _batches(kind: str, world_size: int, device):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        x, y = make_batch("cnn" if kind == "bn" else kind, PER_RANK * world_size, gen)
        yield x.to(device), y.to(device)


def _train(model, kind, rank, world_size, device, stream=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = contextlib.nullcontext()
    if stream is not None:  # the side stream starts after the model's set-up (made on the current stream)
        stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(stream)
    with ctx:
        for x, y in _batches(kind, world_size, device):
            lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x[lo:hi]).float(), y[lo:hi])
            loss.backward()
            opt.step()
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _half_batches(kind, world_size, device):
    """One process: each step's gradient is the average of the per-rank half-batch gradients (a/2 + b/2)."""
    model = _model(kind, 1000, device)  # rank 0's init, which DDP broadcasts
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in _batches(kind, world_size, device):
        per_rank = []
        for r in range(world_size):
            model.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                F.cross_entropy(model(x[r * PER_RANK:(r + 1) * PER_RANK]).float(), y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] / world_size for g in per_rank)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _wrap(cls, module, device, **kwargs):
    ids = [device.index] if device.type == "cuda" else None
    return cls(module, device_ids=ids, **kwargs)


def _parity(rank, world_size, device) -> dict:
    import lockstep
    from lockstep.ddp.autotune import AutoBucketCap
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch_ddp = nn.parallel.DistributedDataParallel
    out = {}
    for kind in ("transformer", "bn"):
        seed = 1000 + rank  # a different init per rank: the start-up broadcast is tested too
        ref = _train(_wrap(torch_ddp, _model(kind, seed, device), device), kind, rank, world_size, device)
        out[f"{kind}/torch"] = ref
        for name, view in (("copy", False), ("view", True), ("alias", None)):
            model = _wrap(lockstep.DistributedDataParallel, _model(kind, seed, device), device, gradient_as_bucket_view=view)
            out[f"{kind}/{name}"] = _train(model, kind, rank, world_size, device)
        # bucket_cap_mb="auto"'s trials (on a GPU each trial step waits for the device) and its broadcast decision
        auto = _wrap(lockstep.DistributedDataParallel, _model(kind, seed, device), device,
                     bucket_cap_mb=AutoBucketCap(caps_mb=(0.01, None), warmup_steps=1, timed_steps=1))
        out[f"{kind}/auto"] = _train(auto, kind, rank, world_size, device)
        out[f"{kind}/auto_result"] = auto.reducer.tuner.result
        torch_fp16 = _wrap(torch_ddp, _model(kind, seed, device), device)
        torch_fp16.register_comm_hook(None, default_hooks.fp16_compress_hook)
        mine_fp16 = _wrap(lockstep.DistributedDataParallel, _model(kind, seed, device), device)
        mine_fp16.register_comm_hook(None, lockstep.comm_hooks.fp16_compress_hook)
        out[f"{kind}/torch_fp16"] = _train(torch_fp16, kind, rank, world_size, device)
        out[f"{kind}/fp16"] = _train(mine_fp16, kind, rank, world_size, device)
        if rank == 0:
            out[f"{kind}/half_batches"] = _half_batches(kind, world_size, device)
    return out


def _missing_late(rank, world_size, device) -> dict:
    """The CUDA path of the missing-gradient flag, not forced: it must be deferred on CUDA, at once on CPU."""
    import lockstep

    torch.manual_seed(0)
    model = _wrap(lockstep.DistributedDataParallel, Branchy().to(device), device)
    x = torch.randn(4, 8, device=device)
    events = []
    try:
        model(x, branch="both").sum().backward()
        events.append("complete backward")
        model(x, branch={0: "a"}.get(rank, "both")).sum().backward()  # rank 0 leaves head b without a gradient
        events.append("missing backward")
        model(x, branch="both").sum().backward()
        events.append("next backward")
    except RuntimeError as e:
        events.append(f"raised: {e}")
    return {"events": events}


def _side_stream(rank, world_size, device) -> dict:
    """torch's test_DistributedDataParallel_non_default_stream, as parity: every step on a side stream."""
    if device.type != "cuda":
        return {"skipped": "CUDA streams"}
    import lockstep

    stream = torch.cuda.Stream()
    torch_ddp = _wrap(nn.parallel.DistributedDataParallel, _model("transformer", 7, device), device)
    mine = _wrap(lockstep.DistributedDataParallel, _model("transformer", 7, device), device)
    return {"torch": _train(torch_ddp, "transformer", rank, world_size, device, stream),
            "lockstep": _train(mine, "transformer", rank, world_size, device, stream)}


def _where(error: BaseException) -> str:
    """The innermost frames of lockstep's that raised ``error``: a failing sync check names the line to fix."""
    import traceback

    frames = [f"{f.filename.rsplit('/src/', 1)[-1]}:{f.lineno} {f.name}"
              for f in traceback.extract_tb(error.__traceback__) if "/src/lockstep/" in f.filename]
    return " <- ".join(reversed(frames[-4:])) or "no lockstep frame"


def _host_syncs(rank, world_size, device) -> dict:
    """Steady-state steps under sync debug mode "error": the text of the first sync each setting makes, or None."""
    if device.type != "cuda" or world_size != 1:
        return {"skipped": "NCCL at world size 1 only (gloo's CUDA all-reduce syncs by design)"}
    import lockstep
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def first_sync(model, kind, hook=None):
        if hook is not None:
            model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batches = list(_batches(kind, 1, device))
        for i, (x, y) in enumerate(batches):
            steady = i >= 3  # the first forward checks replicas, the first backward rebuilds the buckets
            torch.cuda.set_sync_debug_mode("error" if steady else 0)
            try:
                opt.zero_grad()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
            except RuntimeError as e:
                return f"step {i}: {e} at {_where(e)}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return None

    out = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ones(1, device=device).item()
        out["mode_works"] = False
    except RuntimeError:
        out["mode_works"] = True  # the check can fail: a sync does raise
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for kind in ("transformer", "bn"):
        for name, view in (("copy", False), ("view", True), ("alias", None)):
            model = _wrap(lockstep.DistributedDataParallel, _model(kind, 3, device), device, gradient_as_bucket_view=view)
            out[f"{kind}/{name}"] = first_sync(model, kind)
        model = _wrap(lockstep.DistributedDataParallel, _model(kind, 3, device), device)
        out[f"{kind}/fp16"] = first_sync(model, kind, lockstep.comm_hooks.fp16_compress_hook)
        out[f"{kind}/torch"] = first_sync(_wrap(nn.parallel.DistributedDataParallel, _model(kind, 3, device), device), kind)
        out[f"{kind}/torch_fp16"] = first_sync(_wrap(nn.parallel.DistributedDataParallel, _model(kind, 3, device), device),
                                               kind, default_hooks.fp16_compress_hook)
    return out


def _trainer_resume(rank, world_size, device, root) -> dict:
    """test_trainer's crash-and-resume on this device: dropout draws from the CUDA generator there, so an exact
    resume needs the checkpoint to carry and restore the CUDA RNG state (``train/checkpoint``)."""
    import os

    from test_trainer import _params, _train

    root = os.path.join(root, f"{device.type}_{world_size}")
    reference, _ = _train(os.path.join(root, "a"), device=device)
    crashed, summary = _train(os.path.join(root, "b"), crash_at=7, device=device)
    resumed, _ = _train(os.path.join(root, "b"), init_seed=99, resume=True, device=device)
    return {"device": str(next(resumed.model.parameters()).device), "crashed": summary is None,
            "reference": [p.cpu() for p in _params(reference.model)], "resumed": [p.cpu() for p in _params(resumed.model)],
            "from": os.path.basename(str(resumed.resumed_from))}


def _cases(rank, world_size, device_type, root):
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        device = torch.device("cpu")
    return {"parity": _parity(rank, world_size, device), "missing": _missing_late(rank, world_size, device),
            "stream": _side_stream(rank, world_size, device), "syncs": _host_syncs(rank, world_size, device),
            "trainer": _trainer_resume(rank, world_size, device, root)}


@pytest.fixture(scope="module")
def nccl_1(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nccl_1"))
    return run_ranks(_cases, world_size=1, backend="nccl", args=("cuda", root), env=DETERMINISTIC_ENV, timeout_s=600)


@pytest.fixture(scope="module")
def gloo_2_cuda(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gloo_2_cuda"))
    return run_ranks(_cases, world_size=2, backend="gloo", args=("cuda", root), env=DETERMINISTIC_ENV, timeout_s=600)


@pytest.fixture(scope="module")
def gloo_2_cpu(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gloo_2_cpu"))
    return run_ranks(_cases, world_size=2, backend="gloo", args=("cpu", root), timeout_s=300)


def _check_parity(results, world_size):
    for rank, res in enumerate(results):
        p = res["parity"]
        for kind in ("transformer", "bn"):
            for name in ("copy", "view", "alias", "auto"):
                diff = (p[f"{kind}/{name}"] - p[f"{kind}/torch"]).abs().max().item()
                assert diff == 0.0, f"rank {rank} {kind} {name}: max diff {diff} to torch's DDP"
            diff = (p[f"{kind}/fp16"] - p[f"{kind}/torch_fp16"]).abs().max().item()
            assert diff == 0.0, f"rank {rank} {kind} fp16 hook: max diff {diff} to torch's DDP with its hook"
            if rank == 0 and world_size == 2:
                diff = (p[f"{kind}/copy"] - p[f"{kind}/half_batches"]).abs().max().item()
                assert diff == 0.0, f"{kind}: max diff {diff} to one process averaging the half-batch gradients"
    for kind in ("transformer", "bn"):  # the replicas agree, and on the tuned layout (decided at the 6th forward)
        assert results[0]["parity"][f"{kind}/auto_result"]["chosen_mb"] in (0.01, None)
        assert all(r["parity"][f"{kind}/auto_result"] == results[0]["parity"][f"{kind}/auto_result"] for r in results)
        assert all(torch.equal(r["parity"][f"{kind}/copy"], results[0]["parity"][f"{kind}/copy"]) for r in results)


def _check_trainer(results, device_type):
    for rank, res in enumerate(results):
        t = res["trainer"]
        assert t["device"].startswith(device_type) and t["crashed"] and t["from"] == "ckpt-000000006.pt", (rank, t["device"])
        assert all(torch.equal(a, b) for a, b in zip(t["reference"], t["resumed"])), f"rank {rank}: the resume diverged"


def _check_missing(results, deferred):
    for rank, res in enumerate(results):
        events = res["missing"]["events"]
        if deferred:  # raised at the backward after the one that missed, on every rank
            assert events[:2] == ["complete backward", "missing backward"], (rank, events)
            assert events[2].startswith("raised:") and "received no gradient in the previous backward" in events[2]
        else:
            assert events[0] == "complete backward" and "received no gradient in this backward" in events[1], (rank, events)
        assert "rank 0: 'b.weight', 'b.bias'" in events[-1], (rank, events)


@needs_cuda
def test_nccl_world_size_1(nccl_1):
    _check_parity(nccl_1, 1)
    _check_missing(nccl_1, deferred=True)
    _check_trainer(nccl_1, "cuda")
    stream = nccl_1[0]["stream"]
    assert torch.equal(stream["lockstep"], stream["torch"])
    syncs = nccl_1[0]["syncs"]
    assert syncs.pop("mode_works") is True
    theirs = {k: v for k, v in syncs.items() if k.endswith(("/torch", "/torch_fp16"))}
    mine = {k: v for k, v in syncs.items() if k not in theirs}
    assert all(v is None for v in mine.values()), f"host syncs on lockstep's step path: {mine} (torch's DDP: {theirs})"


@needs_cuda
def test_two_ranks_on_one_gpu_gloo(gloo_2_cuda):
    _check_parity(gloo_2_cuda, 2)
    _check_missing(gloo_2_cuda, deferred=True)
    _check_trainer(gloo_2_cuda, "cuda")
    for res in gloo_2_cuda:
        assert torch.equal(res["stream"]["lockstep"], res["stream"]["torch"])


def test_cases_on_cpu(gloo_2_cpu):
    """The same cases on CPU (this machine has no GPU): parity holds, the flag is read at once, the CUDA-only cases
    say they were skipped."""
    _check_parity(gloo_2_cpu, 2)
    _check_missing(gloo_2_cpu, deferred=False)
    _check_trainer(gloo_2_cpu, "cpu")
    for res in gloo_2_cpu:
        assert "skipped" in res["stream"] and "skipped" in res["syncs"]
