"""ZeRO-1 with lockstep, as ``lockstep plan`` tells users to get it: torch's ZeroRedundancyOptimizer over
lockstep's DDP gives the parameters torch's DDP with the same optimizer gives, bit for bit, on 2 gloo ranks.

Each rank steps only its shard of AdamW's state and broadcasts its parameters; the test also checks that
the state really is sharded (no rank holds all of it), so a ZeroRedundancyOptimizer that fell back to a
plain optimizer could not pass. One spawned group (~10 s).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dist_utils import run_ranks
from lockstep import DistributedDataParallel as LockstepDDP

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def _train(ddp_class, rank: int, as_bucket_view: bool, bucket_cap_mb: float):
    model = ddp_class(_model(), bucket_cap_mb=bucket_cap_mb)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                  parameters_as_bucket_view=as_bucket_view)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the averaging matters
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
        opt.step()
    shard = len(opt.optim.state)  # parameters whose AdamW state this rank holds
    return [p.detach().clone() for p in model.module.parameters()], shard


def _case(rank, world_size):
    out = {}
    for as_bucket_view in (False, True):
        for bucket_cap_mb in (25.0, 0.005):  # one bucket; several (the smallest layers share one)
            ours, our_shard = _train(LockstepDDP, rank, as_bucket_view, bucket_cap_mb)
            theirs, their_shard = _train(TorchDDP, rank, as_bucket_view, bucket_cap_mb)
            out[(as_bucket_view, bucket_cap_mb)] = {
                "equal": [torch.equal(a, b) for a, b in zip(ours, theirs)],
                "moved": any(not torch.equal(a, b) for a, b in zip(ours, [p.detach() for p in _model().parameters()])),
                "shards": (our_shard, their_shard), "nparams": len(ours)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_case, 2, timeout_s=180)


def test_lockstep_ddp_with_zero_redundancy_optimizer_equals_torch_ddp(results):
    for rank, per_rank in enumerate(results):
        for key, r in per_rank.items():
            assert all(r["equal"]), f"rank {rank}, (parameters_as_bucket_view, bucket_cap_mb)={key}: {r['equal']}"
            assert r["moved"]  # the optimizer did step
            ours, theirs = r["shards"]
            assert ours == theirs and 0 < ours < r["nparams"]  # sharded: each rank holds part of the state
    for key in results[0]:
        assert results[0][key]["shards"][0] + results[1][key]["shards"][0] == results[0][key]["nparams"]
