"""The per-parameter hook's common path (``lockstep.ddp.reducer.make_hook``): taken where it should be, and equal to torch.

The hook does the common case itself from the second backward on (buckets rebuilt, copies, no
unused-parameter tracking); everything else goes through ``Reducer.on_grad``. These cases check
which path ran (by counting ``on_grad`` calls), that buckets still launch during backward on the
common path, that its results equal torch's DDP bit for bit, and that an error it must not swallow
(a gradient twice in one backward) still comes with the same text.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_utils import run_ranks


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


class _SometimesTwice(nn.Module):
    """A layer run twice through reentrant checkpointing when ``twice`` is set: its hook fires twice."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.twice = False

    def forward(self, x):
        h = torch.tanh(self.layer(torch.relu(self.inp(x))))
        if self.twice:
            h = checkpoint(lambda t: torch.tanh(self.layer(t)), h, use_reentrant=True)
        return self.out(h)


def _count_slow(model):
    calls = []
    slow = model.reducer.on_grad

    def counted(index, param):
        calls.append(index)
        slow(index, param)

    model.reducer.on_grad = counted
    return calls


def _slow_calls_per_step(rank, kwargs, steps=3, hook=None):
    """How many hooks took the slow path in each of ``steps`` backwards, and the final parameters."""
    import lockstep

    model = lockstep.DistributedDataParallel(_mlp(), **kwargs)
    if hook is not None:
        model.register_comm_hook(None, hook)
    calls = _count_slow(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 32, generator=g)), torch.randint(0, 5, (8,), generator=g)).backward()
        opt.step()
        per_step.append(len(calls))
        calls.clear()
    return per_step


def _parity(rank, kwargs, hook_name=None, set_to_none=True, accumulate=1):
    """Four steps of lockstep (common path from step 2) and torch's DDP: max abs difference of parameters and grads."""
    import lockstep
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    models = [lockstep.DistributedDataParallel(_mlp(), **kwargs), nn.parallel.DistributedDataParallel(_mlp(), **kwargs)]
    if hook_name == "fp16":
        for m in models:
            m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    g = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(4):
        batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(accumulate)]
        for model, opt in zip(models, opts):
            opt.zero_grad(set_to_none=set_to_none)
            for i, (x, y) in enumerate(batches):
                sync = i == len(batches) - 1
                with (model.no_sync() if not sync else _null()):
                    F.cross_entropy(model(x), y).backward()
            opt.step()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            worst = max(worst, (a - b).abs().max().item(), (a.grad - b.grad).abs().max().item())
    return worst


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _overlap_on_common_path(rank):
    """At each bucket launch of step 3: how many parameters of the model had their gradient by then."""
    import lockstep

    model = lockstep.DistributedDataParallel(_mlp(), bucket_cap_mb=0.005)
    reducer = model.reducer
    seen_at_launch = []
    launch = reducer._launch

    def recording(bucket):
        seen_at_launch.append((sum(sum(b.seen) for b in reducer.buckets), (reducer.step is not None and reducer.step.plan.fast is not None)))
        launch(bucket)

    reducer._launch = recording  # the launch order is rebuilt after step 1 and takes it from here
    x, y = torch.randn(8, 32), torch.randint(0, 5, (8,))
    for _ in range(3):
        seen_at_launch.clear()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
    return seen_at_launch, len(list(model.parameters())), len(reducer.buckets)


def _twice_after_common_steps(rank):
    import lockstep

    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(_SometimesTwice())
    calls = _count_slow(model)
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).sum().backward()
    fast_before = len(calls) == len(list(model.parameters()))  # step 1 only: steps 2 went the common path
    model.module.twice = True
    try:
        model(x).sum().backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works: no rank is left inside a collective
    return fast_before, error, t.item()


def _cases(rank, world_size):
    from lockstep.comm_hooks import fp16_compress_hook

    return {
        "slow_calls": {
            "default": _slow_calls_per_step(rank, {}),
            "small_buckets": _slow_calls_per_step(rank, {"bucket_cap_mb": 0.005}),
            "fp16_hook": _slow_calls_per_step(rank, {}, hook=fp16_compress_hook),
            "find_unused": _slow_calls_per_step(rank, {"find_unused_parameters": True}),
            "static_graph": _slow_calls_per_step(rank, {"static_graph": True}),
            "bucket_view": _slow_calls_per_step(rank, {"gradient_as_bucket_view": True}),
        },
        "parity": {
            "default": _parity(rank, {}),
            "small_buckets": _parity(rank, {"bucket_cap_mb": 0.005}),
            "fp16_hook": _parity(rank, {"bucket_cap_mb": 0.005}, hook_name="fp16"),
            "zeros_accumulate": _parity(rank, {"bucket_cap_mb": 0.005}, set_to_none=False, accumulate=3),
        },
        "overlap": _overlap_on_common_path(rank),
        "twice": _twice_after_common_steps(rank),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 2, timeout_s=180)


def test_common_path_from_the_second_backward(results):
    num_params = 8
    for rank in range(2):
        calls = results[rank]["slow_calls"]
        # Step 1 records the ready order for the rebuild (slow); then every hook is on the common path.
        for case in ("default", "small_buckets", "fp16_hook"):
            assert calls[case] == [num_params, 0, 0], case
        # Modes that need more per hook stay on the slow path.
        for case in ("find_unused", "static_graph", "bucket_view"):
            assert calls[case] == [num_params] * 3, case


@pytest.mark.parametrize("case", ["default", "small_buckets", "fp16_hook", "zeros_accumulate"])
def test_common_path_equals_torchs_ddp_bit_for_bit(results, case):
    for rank in range(2):
        assert results[rank]["parity"][case] == 0.0


def test_common_path_launches_buckets_during_backward(results):
    for rank in range(2):
        seen_at_launch, num_params, num_buckets = results[rank]["overlap"]
        assert num_buckets >= 3 and len(seen_at_launch) == num_buckets
        assert all(fast for _, fast in seen_at_launch)
        # Buckets went out while gradients were still to come (every launch but the last).
        assert all(n < num_params for n, _ in seen_at_launch[:-1])
        assert [n for n, _ in seen_at_launch] == sorted(n for n, _ in seen_at_launch)


def test_gradient_twice_on_the_common_path_still_raises(results):
    for rank in range(2):
        fast_before, error, alive = results[rank]["twice"]
        assert fast_before
        assert error is not None and "received its gradient twice" in error and "'layer." in error
        assert "static_graph=True" in error
        assert alive == 2.0
