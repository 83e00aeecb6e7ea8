"""``reduce_in(ddp, torch.float32)`` (``ddp/wide_reduce.py``): a bf16 model's gradients summed in fp32.

The reference is computed by hand on every rank from the ranks' own local gradients (all-gathered): each scaled by
1/world size in bf16 (what the bucket holds), summed in fp32 (exact: three 8-bit mantissas) and rounded to bf16 once.
At 3 ranks (oversubscribed: correctness only) that differs from the bf16 sum of the default DDP, whose ring rounds
after each addition. Then the refusals, each one line naming the thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 8)).bfloat16()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 64, generator=g).bfloat16(), torch.randn(16, 8, generator=g).bfloat16()


def _local_grads(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    nn.functional.mse_loss(module(x), y).backward()
    return [p.grad.detach().clone() for p in module.parameters()]


def _wide_sum_by_hand(local: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """What the wide reduction must give: each rank's gradient times 1/world size in bf16, summed in fp32, rounded."""
    out = []
    for g in local:
        gathered = [torch.empty_like(g) for _ in range(world_size)]
        dist.all_gather(gathered, g)
        scaled = [(t * (1.0 / world_size)).float() for t in gathered]
        out.append(torch.stack(scaled).sum(0).to(torch.bfloat16))
    return out


def _grads_per_step(rank: int, world_size: int) -> dict:
    import lockstep
    from lockstep.ddp.wide_reduce import reduce_in

    runs: dict[str, list] = {"wide": [], "by_hand": [], "default": []}
    models = {"wide": lockstep.DistributedDataParallel(_model()), "default": lockstep.DistributedDataParallel(_model())}
    reduce_in(models["wide"], torch.float32)
    reference = _model()
    for step in range(STEPS):
        x, y = _batch(rank, step)
        runs["by_hand"].append(_wide_sum_by_hand(_local_grads(reference, x, y), world_size))
        for name, ddp in models.items():
            ddp.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            runs[name].append([p.grad.detach().clone() for p in ddp.parameters()])
    return runs


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for step_a, step_b in zip(a, b) for x, y in zip(step_a, step_b))


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return run_ranks(_grads_per_step, 3)


def test_bf16_gradients_are_summed_in_fp32_and_rounded_once_at_3_ranks(three_ranks):
    for rank, runs in enumerate(three_ranks):
        assert _same(runs["wide"], runs["by_hand"]), f"rank {rank}: the wide reduction is not the fp32 sum"
        # the strategy changed something: the ring's bf16 roundings differ from the one rounding somewhere
        assert not _same(runs["wide"], runs["default"]), "the fp32 and the bf16 sums agree everywhere: no test"
    assert _same(three_ranks[0]["wide"], three_ranks[2]["wide"])  # every replica holds the same average


def _refusals(rank: int, world_size: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import lockstep
    from lockstep.ddp.wide_reduce import reduce_in

    said = {}
    for case in ("hook_after", "hook_before", "twice", "int_dtype"):
        ddp = lockstep.DistributedDataParallel(_model())
        try:
            if case == "hook_before":
                ddp.register_comm_hook(None, allreduce_hook)
            if case == "int_dtype":
                reduce_in(ddp, torch.int32)
            reduce_in(ddp, torch.float32)
            if case == "twice":
                reduce_in(ddp, torch.float64)
            if case == "hook_after":
                ddp.register_comm_hook(None, allreduce_hook)
        except (ValueError, RuntimeError) as error:
            said[case] = str(error)
    return said


def test_a_comm_hook_a_second_binding_and_a_bad_dtype_are_refused_in_one_line():
    said = run_ranks(_refusals, 2)[0]
    assert said["hook_after"] == ("reduce_in: a comm hook (allreduce_hook) decides what goes on the wire itself; "
                                  "use one or the other")
    assert said["hook_before"] == said["hook_after"]
    assert said["twice"].startswith("reduce_in: a strategy is bound already (wide all-reduce; ") and \
        "\n" not in said["twice"]
    assert said["int_dtype"] == ("reduce_in: dtype must be a floating dtype (torch.float32, torch.float64), "
                                 "got torch.int32")
