"""Parity of lockstep's DDP with torch's DDP, the naive reducer and single-process training.

One group of 2 ranks runs every case (spawning costs ~5 s a rank); the test functions
assert on what it returned. Each rank starts from a different random init, so the
start-up broadcast is part of what is tested. At 2 ranks a/2 + b/2 is exact, so the
bar against torch's DDP and the half-batch reference is max abs diff 0.0.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks
from models import build, make_batch

KINDS = ["mlp", "cnn", "transformer"]
STEPS = 20
PER_RANK = 8
MICRO = 4


def _train(model, kind, rank, world_size, micro=1, set_to_none=True, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)  # same global batches on every rank; each takes its shard
    for _ in range(steps):
        x, y = make_batch(kind, PER_RANK * micro * world_size, gen)
        lo, hi = rank * PER_RANK * micro, (rank + 1) * PER_RANK * micro
        opt.zero_grad(set_to_none=set_to_none)
        for m, (xm, ym) in enumerate(zip(x[lo:hi].chunk(micro), y[lo:hi].chunk(micro))):
            ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                (F.cross_entropy(model(xm), ym) / micro).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _single_process(kind, world_size, micro=1, global_batch=False, steps=STEPS):
    """Rank 0's init; each step averages the per-rank accumulated gradients (a/2 + b/2), or uses the global batch."""
    model = build(kind, 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        x, y = make_batch(kind, PER_RANK * micro * world_size, gen)
        opt.zero_grad()
        if global_batch:
            F.cross_entropy(model(x), y).backward()
        else:
            per_rank = []
            for r in range(world_size):
                model.zero_grad()
                lo, hi = r * PER_RANK * micro, (r + 1) * PER_RANK * micro
                for xm, ym in zip(x[lo:hi].chunk(micro), y[lo:hi].chunk(micro)):
                    (F.cross_entropy(model(xm), ym) / micro).backward()
                per_rank.append([p.grad.clone() for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                p.grad = sum(g[i] / world_size for g in per_rank)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _variants(rank, world_size, kind):
    import lockstep

    seed = 1000 + rank  # a different init on every rank: DDP must broadcast rank 0's
    out = {
        "torch": _train(nn.parallel.DistributedDataParallel(build(kind, seed)), kind, rank, world_size),
        "lockstep": _train(lockstep.DistributedDataParallel(build(kind, seed)), kind, rank, world_size),
    }
    if world_size == 2:
        out["naive"] = _train(lockstep.NaiveDistributedDataParallel(build(kind, seed)), kind, rank, world_size)
        for cap in (0.001, 1, 100):
            out[f"cap{cap}"] = _train(lockstep.DistributedDataParallel(build(kind, seed), bucket_cap_mb=cap), kind, rank, world_size)
        # gradient_as_bucket_view=None makes .grad its bucket slot (no copy back); the default, False, is torch's
        # copies; both exact.
        out["alias"] = _train(lockstep.DistributedDataParallel(build(kind, seed), gradient_as_bucket_view=None), kind, rank, world_size)
        out["keep"] = _train(lockstep.DistributedDataParallel(build(kind, seed), gradient_as_bucket_view=None), kind, rank, world_size,
                             set_to_none=False)
        out["nosync_keep"] = _train(lockstep.DistributedDataParallel(build(kind, seed), gradient_as_bucket_view=None), kind, rank,
                                    world_size, micro=MICRO, set_to_none=False)
        out["view"] = _train(lockstep.DistributedDataParallel(build(kind, seed), gradient_as_bucket_view=True), kind, rank, world_size)
        out["view_keep"] = _train(
            lockstep.DistributedDataParallel(build(kind, seed), gradient_as_bucket_view=True, bucket_cap_mb=0.001),
            kind, rank, world_size, set_to_none=False,
        )
        out["torch_nosync"] = _train(nn.parallel.DistributedDataParallel(build(kind, seed)), kind, rank, world_size, micro=MICRO)
        out["nosync"] = _train(lockstep.DistributedDataParallel(build(kind, seed)), kind, rank, world_size, micro=MICRO)
        out["nosync_view"] = _train(
            lockstep.DistributedDataParallel(build(kind, seed), gradient_as_bucket_view=True, bucket_cap_mb=0.001),
            kind, rank, world_size, micro=MICRO, set_to_none=False,
        )
        out["single_half"] = _single_process(kind, world_size)
        out["single_half_nosync"] = _single_process(kind, world_size, micro=MICRO)
        out["single_global"] = _single_process(kind, world_size, global_batch=True)
    return out


def _parity_worker(rank, world_size, kinds):
    return {kind: _variants(rank, world_size, kind) for kind in kinds}


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_parity_worker, 2, args=(KINDS,), timeout_s=400)


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(_parity_worker, 3, args=(["mlp", "transformer"],), timeout_s=400)


@pytest.mark.parametrize("kind", KINDS)
def test_transformer_has_50_tensors(kind):
    if kind == "transformer":
        assert len(list(build(kind, 0).parameters())) >= 50


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "variant,reference",
    [
        ("lockstep", "torch"),
        ("lockstep", "naive"),
        ("lockstep", "single_half"),
        ("cap0.001", "torch"),
        ("cap1", "torch"),
        ("cap100", "torch"),
        ("alias", "torch"),
        ("keep", "torch"),
        ("nosync_keep", "torch_nosync"),
        ("view", "torch"),
        ("view_keep", "torch"),
        ("nosync", "torch_nosync"),
        ("nosync", "single_half_nosync"),
        ("nosync_view", "torch_nosync"),
    ],
)
def test_exact_parity_two_ranks(two_ranks, kind, variant, reference):
    for rank in range(2):
        assert _max_diff(two_ranks[rank][kind][variant], two_ranks[rank][kind][reference]) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_replicas_identical_and_trained(two_ranks, kind):
    assert _max_diff(two_ranks[0][kind]["lockstep"], two_ranks[1][kind]["lockstep"]) == 0.0
    # The run really moved the parameters away from rank 0's init.
    start = [p.detach() for p in build(kind, 1000).parameters()]
    assert _max_diff(two_ranks[0][kind]["lockstep"], start) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_close_to_global_batch(two_ranks, kind):
    assert _max_diff(two_ranks[0][kind]["lockstep"], two_ranks[0][kind]["single_global"]) < 1e-5


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_three_ranks_close_to_torch(three_ranks, kind):
    for rank in range(3):
        ours, theirs = three_ranks[rank][kind]["lockstep"], three_ranks[rank][kind]["torch"]
        for a, b in zip(ours, theirs):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    assert _max_diff(three_ranks[0][kind]["lockstep"], three_ranks[2][kind]["lockstep"]) == 0.0
