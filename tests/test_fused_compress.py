"""The fp16/bf16 compress hooks run by the reducer itself (``lockstep.ddp.fused_compress``).

One group of 2 gloo ranks runs every case. The evidence:

* parity: 5 SGD steps with torch's and lockstep's fp16/bf16 hooks on lockstep's DDP give the bits of
  torch's DDP with the same hook, with copied gradients (a direct bucket among them), with
  ``gradient_as_bucket_view=True`` and lockstep's ``None``, with ``find_unused_parameters``, and under ``join`` with uneven inputs;
* the path: a declared hook is never called; no all-reduce of the missing-gradient flag is issued
  (the undeclared hook with the same arithmetic issues one per backward); a hook given another
  group is called, not fused;
* a parameter without gradient on one rank still fails on both ranks, naming it (the flag rode in
  the compressed last bucket).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dist_utils import run_ranks

STEPS = 5


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        # The middle weight, 1024 x 1100 float32, is 4.3 MiB: a direct bucket (``DEFAULT_DIRECT_MIN_BYTES``),
        # which the last bucket never is.
        self.body = nn.Sequential(nn.Linear(32, 1100), nn.ReLU(), nn.Linear(1100, 1024), nn.ReLU())
        self.head = nn.Linear(1024, 10)

    def forward(self, x, skip_head_bias: bool = False):
        h = self.body(x)
        return F.linear(h, self.head.weight) if skip_head_bias else self.head(h)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _train(make, hook, state=None, steps: int = STEPS, rank: int = 0, join: bool = False):
    model = make(_model())
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(steps)]
    with model.join() if join else contextlib.nullcontext():
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _all_cases(rank: int, world_size: int) -> dict:
    import lockstep
    from lockstep.comm_hooks import averages_in, bf16_compress, bf16_compress_hook, chain, fp16_compress, fp16_compress_hook, allreduce_hook

    out: dict = {}
    ours = lambda **kw: (lambda m: lockstep.DistributedDataParallel(m, bucket_cap_mb=1, **kw))  # noqa: E731
    torchs = lambda **kw: (lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1, **kw))  # noqa: E731

    # Parity with torch's DDP. torch's DDP refuses its own bf16 hook without NCCL (by name): lockstep's bf16
    # hook on torch's DDP is the reference there (bitwise torch's, test_comm_hooks).
    for view in (False, True, None):  # None: lockstep's .grad in the buckets, torch's default values
        for name, hook, reference in (("fp16", fp16_compress_hook, default_hooks.fp16_compress_hook),
                                      ("torch_fp16", default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook),
                                      ("bf16", bf16_compress_hook, bf16_compress_hook),
                                      ("torch_bf16", default_hooks.bf16_compress_hook, bf16_compress_hook)):
            model, mine = _train(ours(gradient_as_bucket_view=view), hook, rank=rank)
            _, theirs = _train(torchs(gradient_as_bucket_view=bool(view)), reference, rank=rank)
            out[f"parity/{name}/view={view}"] = {
                "max_diff": (mine - theirs).abs().max().item(),
                "fused": model.reducer.fused is not None,
                "direct": model.reducer.direct_launches,
                "compressed": str(model.reducer.buckets[-1].compressed.dtype),
            }

    # With find_unused_parameters the flag travels in the usage bitmap's exchange, and the last bucket is compressed with its spare element all the same.
    model, mine = _train(ours(find_unused_parameters=True), fp16_compress_hook, rank=rank)
    _, theirs = _train(torchs(find_unused_parameters=True), default_hooks.fp16_compress_hook, rank=rank)
    out["find_unused"] = ((mine - theirs).abs().max().item(), model.reducer.fused is not None)

    # The path taken: hook calls and the flag's own all-reduce (dist.all_reduce: the buckets go to the group
    # directly, the flag exchange through dist.all_reduce).
    calls, flag_reduces, real = [], [], dist.all_reduce

    def counting(tensor, *args, **kwargs):  # the flag exchange: one int32 (a called hook's own all-reduces pass too)
        if tensor.dtype == torch.int32 and tensor.numel() == 1:
            flag_reduces.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    def declared(state, bucket):  # declared to average an fp16 copy; must not be called
        calls.append(bucket.index())
        return fp16_compress_hook(state, bucket)

    undeclared = chain(fp16_compress, allreduce_hook)  # the same arithmetic, not declared: called
    other_group = dist.new_group([0, 1])
    for name, hook, state in (("declared", averages_in(torch.float16, declared), None), ("undeclared", undeclared, None),
                              ("other_group", fp16_compress_hook, other_group), ("bf16_chain", chain(bf16_compress, allreduce_hook), None)):
        dist.all_reduce = counting
        try:
            model, flat = _train(ours(), hook, state, rank=rank)
        finally:
            dist.all_reduce = real
        _, reference = _train(torchs(), default_hooks.fp16_compress_hook if "bf16" not in name else bf16_compress_hook, rank=rank)
        out[f"path/{name}"] = {"calls": len(calls), "flag_reduces": len(flag_reduces), "fused": model.reducer.fused is not None,
                               "max_diff": (flat - reference).abs().max().item()}
        calls.clear()
        flag_reduces.clear()

    # Uneven inputs under join: rank 1 has two more batches; the joined rank 0 shadows them.
    _, mine = _train(ours(), fp16_compress_hook, steps=2 + 2 * rank, rank=rank, join=True)
    _, theirs = _train(torchs(), default_hooks.fp16_compress_hook, steps=2 + 2 * rank, rank=rank, join=True)
    out["join"] = (mine - theirs).abs().max().item()

    # A gradient missing on rank 1 only (its forward skips the head's bias): both ranks raise at that backward.
    model = ours()(_model())
    model.register_comm_hook(None, fp16_compress_hook)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    try:
        F.cross_entropy(model(x, skip_head_bias=rank == 1), y).backward()
        out["missing"] = "no error"
    except RuntimeError as e:
        out["missing"] = str(e)
    out["missing_logged"] = model._get_ddp_logging_data().get("error", "")  # torch's logging data notes the error too
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=240)


def test_fused_hooks_equal_torchs_ddp_bit_for_bit(results):
    for rank in range(2):
        cases = {k: v for k, v in results[rank].items() if k.startswith("parity/")}
        assert len(cases) == 12
        for name, case in cases.items():
            assert case["max_diff"] == 0.0, (rank, name, case)
            assert case["fused"], (rank, name)
            assert case["compressed"] == ("torch.float16" if "fp16" in name else "torch.bfloat16"), (name, case)
        # The 4.3 MiB weight went direct with copied gradients (5 steps each), never with .grad in the buckets.
        for name, case in cases.items():
            assert (case["direct"] == STEPS) if name.endswith("view=False") else case["direct"] == 0, (name, case)


def test_fused_hook_with_find_unused_parameters_equals_torchs(results):
    assert results[0]["find_unused"] == (0.0, True) and results[1]["find_unused"] == (0.0, True)


def test_declared_hook_is_run_not_called_and_the_flag_rides(results):
    for rank in range(2):
        declared = results[rank]["path/declared"]
        assert declared == {"calls": 0, "flag_reduces": 0, "fused": True, "max_diff": 0.0}, declared
        # The same arithmetic, undeclared: called for each of its buckets, and one flag all-reduce per backward.
        undeclared = results[rank]["path/undeclared"]
        assert not undeclared["fused"] and undeclared["flag_reduces"] == STEPS and undeclared["max_diff"] == 0.0, undeclared
        bf16 = results[rank]["path/bf16_chain"]
        assert not bf16["fused"] and bf16["flag_reduces"] == STEPS and bf16["max_diff"] == 0.0, bf16


def test_hook_on_another_group_is_called(results):
    for rank in range(2):
        case = results[rank]["path/other_group"]
        assert not case["fused"] and case["flag_reduces"] == STEPS and case["max_diff"] == 0.0, case


def test_join_with_a_fused_hook_equals_torchs(results):
    assert results[0]["join"] == 0.0 and results[1]["join"] == 0.0


def test_missing_gradient_on_one_rank_fails_on_both(results):
    for rank in range(2):
        message = results[rank]["missing"]
        assert "received no gradient" in message and "rank 1: 'head.bias'" in message and "rank 0" not in message, (rank, message)
        assert results[rank]["missing_logged"] == f"<class 'RuntimeError'>: {message}"
