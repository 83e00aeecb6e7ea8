"""The hierarchical all-reduce (``lockstep.collectives.hierarchical``) on 4 real gloo ranks posing as 2 nodes x 2.

The layout comes from the environment as a launcher sets it (GROUP_RANK, LOCAL_WORLD_SIZE=2). One spawned group
runs every case: the choice (default on, False, True's refusals), three SGD steps of a model in several buckets
next to the flat DDP, each stage group's schedule, the bytes across the "link", a failing stage, and shutdown.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

from lockstep.collectives.hierarchical import (
    HierarchicalAllReduce,
    NodeLayout,
    flat_ring_link_nbytes,
    hierarchical_link_nbytes,
    hierarchy_for,
)

WORLD = 4
STEPS = 3
KEYWORD = "DistributedDataParallel: hierarchical_all_reduce"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"


def _choice(rank: int) -> dict:
    from lockstep import DistributedDataParallel as DDP

    on = DDP(_model())
    off = DDP(_model(), hierarchical_all_reduce=False)
    pair = dist.new_group([0, 1])  # every rank makes it; 2 and 3 are outside it
    return {
        "default": None if on.reducer.hierarchy is None else on.reducer.hierarchy.layout.nodes,
        "false": off.reducer.hierarchy,
        "no_env_none": hierarchy_for(dist.group.WORLD, None, KEYWORD, env={}),
        "no_env_true": _error(lambda: hierarchy_for(dist.group.WORLD, True, KEYWORD, env={})),
        "one_node": _error(lambda: hierarchy_for(dist.group.WORLD, True, KEYWORD,
                                                 env={"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "4"})),
        # Gathered: every rank alike, each its own node.
        "one_rank_nodes": _error(lambda: hierarchy_for(dist.group.WORLD, True, KEYWORD,
                                                       env={"GROUP_RANK": str(rank), "LOCAL_WORLD_SIZE": "1"})),
        "subgroup": _error(lambda: hierarchy_for(pair, True, KEYWORD)),
        "not_bool": _error(lambda: DDP(_model(), hierarchical_all_reduce="yes")),
    }


def _expected(local: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The hierarchy's sums, in its order: each rank's gradient scaled by 1/4 at copy-in (exact), then
    (g0 + g1) + (g2 + g3): inside each node, then across. With the exact sums (float64) and the sums of magnitudes."""
    ordered, exact, magnitude = [], [], []
    for grad in local:
        parts = [torch.empty_like(grad) for _ in range(WORLD)]
        dist.all_gather(parts, grad)
        s = [p * 0.25 for p in parts]
        ordered.append((s[0] + s[1]) + (s[2] + s[3]))
        exact.append(sum(p.double() for p in s))
        magnitude.append(sum(p.double().abs() for p in s))
    return ordered, exact, magnitude


def _rounding(grads, exact: list[torch.Tensor], magnitude: list[torch.Tensor]) -> float:
    """The largest error of ``grads`` against the exact sums, in units of u * sum |terms| (u = 2^-24, float32's)."""
    u = 2.0 ** -24
    return max(float(((g.double() - e).abs() / (u * m).clamp_min(1e-300)).max())
               for g, e, m in zip(grads, exact, magnitude))


def _training(rank: int) -> dict:
    from lockstep import DistributedDataParallel as DDP

    hier = DDP(_model(), bucket_cap_mb_list=[0.01], hierarchical_all_reduce=True)
    flat = DDP(_model(), bucket_cap_mb_list=[0.01], hierarchical_all_reduce=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (hier, flat)]
    gen = torch.Generator().manual_seed(rank)
    bitwise, flat_differs, bounds = [], 0, {}
    for step in range(STEPS):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opts[0].zero_grad()
        with hier.no_sync():  # this rank's own gradients at the hierarchy's current parameters
            F.cross_entropy(hier(x), y).backward()
        ordered, exact, magnitude = _expected([p.grad.clone() for p in hier.parameters()])
        for model, opt in zip((hier, flat), opts):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
        hier_grads, flat_grads = [p.grad for p in hier.parameters()], [p.grad for p in flat.parameters()]
        bitwise.append(all(torch.equal(g, e) for g, e in zip(hier_grads, ordered)))
        if step == 0:  # the same parameters in both models: the same terms, summed in another order
            flat_differs = sum(int((g != f).sum()) for g, f in zip(hier_grads, flat_grads))
            bounds = {"hier": _rounding(hier_grads, exact, magnitude), "flat": _rounding(flat_grads, exact, magnitude)}
        for opt in opts:
            opt.step()
    h = hier.reducer.hierarchy
    assert h is not None
    params = torch.cat([p.detach().flatten() for p in hier.parameters()])
    everyone = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(everyone, params)
    flat_params = torch.cat([p.detach().flatten() for p in flat.parameters()])
    return {
        "buckets": len(hier.reducer.buckets), "bitwise_each_step": bitwise, "flat_differs": flat_differs,
        "bounds": bounds, "numel": params.numel(), "param_abs": float((params - flat_params).abs().max()),
        "replicas_equal": all(torch.equal(everyone[0], p) for p in everyone),
        "issued": {k: list(v) for k, v in h.issued.items()}, "cross_nbytes": h.cross_nbytes,
        "submitted_nbytes": 4 * sum(n for _, n in h.issued["node_reduce"]),
        "layout": h.layout,
    }


def _failure() -> dict:
    import time

    h = HierarchicalAllReduce(NodeLayout(((0, 1), (2, 3))))
    ok = torch.ones(6)
    h.submit(ok).wait()
    out: dict = {"sum": ok.tolist()}
    for name, tensor in (("bad", torch.ones(6, dtype=torch.uint16)), ("after", torch.ones(6))):
        start = time.monotonic()
        try:
            h.submit(tensor).wait()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
        out[name + "_s"] = time.monotonic() - start
    h.close()
    try:
        h.submit(torch.ones(6))
        out["closed"] = "no error"
    except RuntimeError as e:
        out["closed"] = str(e)
    return out


def _ranks(rank: int, world_size: int) -> dict:
    import lockstep

    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    out = {"choice": _choice(rank), "training": _training(rank), "failure": _failure()}
    lockstep.shutdown()  # closes the DDP objects' stage threads, then the group
    out["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("lockstep-hierarchical")]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, WORLD, timeout_s=300, pg_timeout_s=60)


def test_chosen_where_the_layout_says_several_nodes(results):
    for r in results:
        c = r["choice"]
        assert c["default"] == ((0, 1), (2, 3))
        assert c["false"] is None and c["no_env_none"] is None
        assert c["no_env_true"].startswith(f"{KEYWORD}=True: the node layout is unknown: none of GROUP_RANK")
        assert "all 4 ranks are on one node" in c["one_node"]
        assert "the job has 4 node(s) of [1] rank(s)" in c["one_rank_nodes"]
        assert "a process group other than the world" in c["subgroup"]
        assert c["not_bool"] == f"{KEYWORD} must be True, False or None, got 'yes'"


def test_sums_are_the_node_then_cross_order_and_replicas_agree(results):
    for r in results:
        t = r["training"]
        assert t["buckets"] >= 3
        # Bit for bit (g0 + g1) + (g2 + g3) of the gradients scaled by 1/4, every step, every bucket.
        assert t["bitwise_each_step"] == [True] * STEPS
        assert t["replicas_equal"]
        # Against the flat ring: the same 4 terms in another order. Both sums are within float32's bound for a sum
        # of 4 (3 roundings: 3 u * sum |terms|) of the exact one; neither is the more exact in general.
        assert t["bounds"]["hier"] <= 3 and t["bounds"]["flat"] <= 3, t["bounds"]
        assert 0 < t["flat_differs"] < t["numel"], t  # some elements differ in their last bits, not most
        # The parameters after 3 SGD steps (lr 0.1) stay within 1e-6 of the flat ring's.
        assert t["param_abs"] < 1e-6, t


def test_each_stage_group_sees_one_schedule(results):
    t = [r["training"] for r in results]
    assert t[0]["issued"]["node_reduce"], "nothing went through the hierarchy"
    for node in ((0, 1), (2, 3)):
        for stage in ("node_reduce", "node_broadcast"):
            assert t[node[0]]["issued"][stage] == t[node[1]]["issued"][stage]
    for cross in ((0, 2), (1, 3)):
        assert t[cross[0]]["issued"]["cross"] == t[cross[1]]["issued"]["cross"]
    # One reduce and one broadcast per chunk per bucket: 2 chunks, buckets x steps (the first step's layout included).
    assert len(t[0]["issued"]["node_reduce"]) == len(t[0]["issued"]["node_broadcast"]) == 2 * len(
        t[0]["issued"]["cross"])


def test_the_link_carries_two_thirds_of_the_flat_rings_bytes(results):
    t = [r["training"] for r in results]
    submitted = t[0]["submitted_nbytes"]
    layout = t[0]["layout"]
    # Counted in the cross stage: a node's ranks together send each bucket once across (their chunks).
    assert t[0]["cross_nbytes"] + t[1]["cross_nbytes"] == submitted
    assert t[2]["cross_nbytes"] + t[3]["cross_nbytes"] == submitted
    # Two nodes: each chunk's ring of 2 sends it once each way, so each direction carries the buffer once.
    assert hierarchical_link_nbytes(submitted, layout) == submitted
    assert flat_ring_link_nbytes(submitted, layout) == submitted * 3 // 2
    assert hierarchical_link_nbytes(submitted, layout) * 3 <= 2 * flat_ring_link_nbytes(submitted, layout)


def test_a_failing_stage_raises_at_the_waiter(results):
    for r in results:
        f = r["failure"]
        assert f["sum"] == [4.0] * 6
        assert "Invalid scalar type" in f["bad"] and f["bad_s"] < 10
        assert "an earlier bucket failed: Invalid scalar type" in f["after"] and f["after_s"] < 10
        assert "used after close()" in f["closed"]
        assert r["threads_left"] == []


def test_link_bytes_by_layout():
    contiguous, interleaved = NodeLayout(((0, 1), (2, 3))), NodeLayout(((0, 2), (1, 3)))
    assert flat_ring_link_nbytes(1000, contiguous) == 1500  # two crossings, one each way, 2(N-1)/N each
    assert flat_ring_link_nbytes(1000, interleaved) == 3000  # every hop crosses
    assert hierarchical_link_nbytes(1000, contiguous) == hierarchical_link_nbytes(1000, interleaved) == 1000
    four = NodeLayout(tuple((2 * n, 2 * n + 1) for n in range(4)))
    assert hierarchical_link_nbytes(1000, four) == 1500 and flat_ring_link_nbytes(1000, four) == 1750
    assert NodeLayout.from_node_ids([1, 0, 1, 0]).nodes == ((1, 3), (0, 2))
    assert NodeLayout.from_node_ids([0, 0, 1]).ranks_per_node is None
