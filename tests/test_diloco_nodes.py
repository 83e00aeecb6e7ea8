"""DiLoCo with several ranks a node (``node_groups``) on 4 real gloo ranks as 2 nodes x 2.

Inside a node lockstep's DDP runs on the node's group; across nodes each bucket crosses from one rank of the node
(local index = bucket index mod 2) and is broadcast inside the node after. One 4-rank group runs every case
(``_cases``) and the tests assert on what each rank returned:

- every rank of every node holds the same parameters after each sync (and the ranks of a node between syncs);
- the parameters equal bit for bit a reference computed by hand in each process, with no collective: two node
  models, each stepped with the mean of its two ranks' half-batch gradients, and the outer step on their mean
  pseudo-gradient (``_reference``). Bit for bit, not "within rounding": with 2 ranks a node and 2 nodes every sum
  has two terms (IEEE addition is commutative, so gloo's order cannot matter) and every division is by 2 (exact for
  normal floats, so DDP dividing before or after the sum gives the same bits); the rest is the same operations on
  the same tensors;
- each rank sends only its own buckets: summed over a node, ``wire_nbytes`` is one model's bytes a sync;
- node ids from the launcher's GROUP_RANK give the same groups as ``node_ids``;
- a DiLoCo built before the node's DDP, from different seeds, and BatchNorm's buffers, still agree on every rank.

The Trainer at 2 x 2 (``diloco_sync_every``; its groups from GROUP_RANK) resumes bit for bit from a checkpoint.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_diloco_trainer import _train
from torch import nn

from lockstep import DiLoCo, DiLoCoConfig, DistributedDataParallel
from lockstep.ddp.diloco import node_groups

NODE_IDS = [0, 0, 1, 1]
STEPS = 12
SMALL_BUCKETS = 0.001  # MiB: 262 floats: the 3 layers' 6 tensors in 4 buckets, 2 sent from each rank of a node


class Net(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 33)
        self.norm = nn.BatchNorm1d(33) if norm else nn.Identity()
        self.fc2 = nn.Linear(33, 17)
        self.fc3 = nn.Linear(17, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.norm(self.fc1(x))))))


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


CONFIGS = {
    "fp32": DiLoCoConfig(sync_every=4, bucket_cap_mb=SMALL_BUCKETS),
    "streaming": DiLoCoConfig(sync_every=4, fragments=2, bucket_cap_mb=SMALL_BUCKETS),  # overlap 1
    "warmup": DiLoCoConfig(sync_every=4, warmup_steps=2, bucket_cap_mb=SMALL_BUCKETS),
    "bf16": DiLoCoConfig(sync_every=4, wire_dtype="bf16", bucket_cap_mb=SMALL_BUCKETS),
}


def _run(rank: int, config: DiLoCoConfig, groups: tuple, diloco_first: bool = False, norm: bool = False) -> dict:
    """Adam inner steps of lockstep's DDP on the node's group under DiLoCo: the parameters after each step."""
    node, cross = groups
    torch.manual_seed(rank)  # different starts: the start-up broadcasts must make them rank 0's
    model = Net(norm)
    if diloco_first:  # DiLoCo's start-up broadcast before the DDP's inside the node
        diloco = DiLoCo(model, config, group=cross, node_group=node)
        ddp = DistributedDataParallel(model, process_group=node, hang_timeout_s=0)
    else:  # the Trainer's order
        ddp = DistributedDataParallel(model, process_group=node, hang_timeout_s=0)
        diloco = DiLoCo(model, config, group=cross, node_group=node)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    after, landed, anchors, buffers = [], [], [], []
    for _ in range(STEPS):
        _loss(ddp, _batch(g)).backward()
        opt.step()
        opt.zero_grad()
        landed.append([s.fragment for s in diloco.step()])
        after.append(_flat(model).clone())
        anchors.append(torch.cat([a.clone() for a in diloco.anchors]))
        buffers.append([b.clone() for b in model.buffers() if b.is_floating_point()])
    return {"after": after, "landed": landed, "anchors": anchors, "buffers": buffers,
            "wire_nbytes": diloco.wire_nbytes, "buckets": diloco.buckets, "fragments": diloco.fragments,
            "numel": sum(p.numel() for p in model.parameters()), "last_sync": diloco.last_sync}


def _reference(config: DiLoCoConfig, buckets: list[list[int]], fragments: list[list[int]]) -> list[list[torch.Tensor]]:
    """Two node models by hand, no collective: each node's inner step the mean of its two ranks' half-batch gradients
    (rank r draws its batches from seed 100 + r, as in ``_run``), every sync the outer SGD on the mean over the nodes
    of (anchor - node's parameters), in the same flat buckets (the outer optimizer's state lines up with them).
    Returns each node's flat parameters after each inner step."""
    torch.manual_seed(0)  # global rank 0's start: what every rank holds after the start-up broadcasts
    start = Net()
    models = [copy.deepcopy(start) for _ in range(2)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(4)]
    params = [list(m.parameters()) for m in models]

    def flat(n: int, b: int) -> torch.Tensor:
        return torch.cat([params[n][i].detach().reshape(-1) for i in buckets[b]])

    def mean_delta(b: int) -> torch.Tensor:  # what the outer all-reduce returns: a sum of two halves
        return (anchors[b] - flat(0, b)) / 2 + (anchors[b] - flat(1, b)) / 2

    def scatter(b: int) -> None:
        for n in range(2):
            offset = 0
            for i in buckets[b]:
                p = params[n][i]
                p.detach().copy_(anchors[b][offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    anchors = [torch.cat([p.detach().reshape(-1) for i in b for p in [params[0][i]]]) for b in buckets]
    outer = torch.optim.SGD(anchors, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.nesterov)
    pending: list[tuple[int, int, list[torch.Tensor]]] = []
    after: list[list[torch.Tensor]] = []
    for step in range(1, STEPS + 1):
        for n in range(2):
            grads = []
            for r in (2 * n, 2 * n + 1):
                models[n].zero_grad()
                _loss(models[n], _batch(gens[r])).backward()
                grads.append([p.grad.clone() for p in params[n]])
            for p, ga, gb in zip(params[n], *grads):
                p.grad = (ga + gb) / 2
            opts[n].step()
        with torch.no_grad():
            if config.averages_at(step):
                for b in range(len(buckets)):
                    anchors[b].sub_(mean_delta(b))
                    scatter(b)
            else:
                pending += [(k, step, [mean_delta(b) for b in fragments[k]]) for k in config.launches_at(step)]
                while pending and pending[0][1] + config.overlap <= step:
                    k, _, averaged = pending.pop(0)
                    for b, avg in zip(fragments[k], averaged):
                        anchors[b].grad = avg
                    outer.step()
                    for b in fragments[k]:
                        anchors[b].grad = None
                        scatter(b)
        after.append([_flat(m).clone() for m in models])
    return after


def _groups_from_env(rank: int) -> dict:
    """The launcher's GROUP_RANK (``collectives.hierarchical.node_id_from_env``) gives the same groups."""
    os.environ["GROUP_RANK"] = str(NODE_IDS[rank])
    try:
        node, cross = node_groups()
    finally:
        del os.environ["GROUP_RANK"]
    return {"node": dist.get_process_group_ranks(node), "cross": dist.get_process_group_ranks(cross),
            "groups": (node, cross)}


def _cases(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    groups = node_groups(node_ids=NODE_IDS)
    env = _groups_from_env(rank)
    out: dict = {"env": {"node": env["node"], "cross": env["cross"]},
                 "ids": {"node": dist.get_process_group_ranks(groups[0]),
                         "cross": dist.get_process_group_ranks(groups[1])}}
    out.update({name: _run(rank, config, groups) for name, config in CONFIGS.items()})
    out["env_run"] = _run(rank, CONFIGS["fp32"], env["groups"])
    out["diloco_first"] = _run(rank, CONFIGS["streaming"], groups, diloco_first=True)
    out["norm"] = _run(rank, CONFIGS["fp32"], groups, norm=True)
    if rank == 0:  # the reference is the same on every rank: computed once
        out["reference"] = {name: _reference(CONFIGS[name], out[name]["buckets"], out[name]["fragments"])
                            for name in ("fp32", "streaming", "warmup")}
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world_size=4, timeout_s=300)


def test_groups_from_node_ids_and_from_group_rank(ranks):
    for rank, r in enumerate(ranks):
        node = rank // 2
        assert r["ids"] == r["env"] == {"node": [2 * node, 2 * node + 1], "cross": [rank % 2, rank % 2 + 2]}


def _synced_steps(result: dict) -> list[int]:
    return [t for t, landed in enumerate(result["landed"]) if landed]


@pytest.mark.parametrize("name", [*CONFIGS, "env_run", "diloco_first", "norm"])
def test_every_rank_of_every_node_equal_after_each_sync(ranks, name):
    results = [r[name] for r in ranks]
    assert all(r["landed"] == results[0]["landed"] for r in results)
    fragments = len(results[0]["fragments"])
    synced = _synced_steps(results[0])
    assert synced and (fragments > 1 or synced == [3, 7, 11] or name == "warmup")
    for t in range(STEPS):
        for rank, r in enumerate(results):
            assert torch.equal(r["anchors"][t], results[0]["anchors"][t]), f"rank {rank}, step {t + 1}"
        for node in (0, 1):  # a node's ranks: DDP on the node's group, equal at every step
            assert torch.equal(results[2 * node]["after"][t], results[2 * node + 1]["after"][t]), f"step {t + 1}"
        if fragments == 1 and t in synced:  # every rank of every node, after each (whole-model) sync
            for rank, r in enumerate(results):
                assert torch.equal(r["after"][t], results[0]["after"][t]), f"rank {rank}, step {t + 1}"
                assert all(torch.equal(a, b) for a, b in zip(r["buffers"][t], results[0]["buffers"][t]))
        elif fragments == 1:
            assert not torch.equal(results[0]["after"][t], results[2]["after"][t])  # nodes apart between syncs
    if name == "norm":
        assert len(results[0]["buffers"][0]) == 2  # BatchNorm's running mean and variance were compared


@pytest.mark.parametrize("name", ["fp32", "streaming", "warmup"])
def test_equals_two_nodes_of_averaged_gradients_bit_for_bit(ranks, name):
    reference = ranks[0]["reference"][name]
    moved = (reference[-1][0] - reference[0][0]).abs().max().item()
    assert moved > 1e-2  # the runs moved: the comparison has something to compare
    for rank, r in enumerate(ranks):
        for t in range(STEPS):
            expected = reference[t][rank // 2]
            assert torch.equal(r[name]["after"][t], expected), (
                f"rank {rank}, step {t + 1}: max diff {(r[name]['after'][t] - expected).abs().max().item():.3g}")


@pytest.mark.parametrize("name, wire_bytes", [("fp32", 4), ("bf16", 2), ("streaming", 4)])
def test_each_rank_sends_only_its_buckets(ranks, name, wire_bytes):
    result = ranks[0][name]
    buckets, fragments = result["buckets"], result["fragments"]
    sizes = [p.numel() for p in Net().parameters()]
    launched = [k for step in range(1, STEPS + 1) for k in CONFIGS[name].launches_at(step)]  # in flight included
    assert len(launched) >= 3

    def numel(rank: int | None) -> int:  # of the launched fragments' buckets that ``rank`` sends (None: all)
        return sum(sizes[i] for k in launched for b in fragments[k] if rank is None or b % 2 == rank % 2
                   for i in buckets[b])

    for rank, r in enumerate(ranks):
        assert 0 < numel(rank) < numel(None)
        assert r[name]["wire_nbytes"] == numel(rank) * wire_bytes, rank
    for node in (0, 1):
        node_nbytes = ranks[2 * node][name]["wire_nbytes"] + ranks[2 * node + 1][name]["wire_nbytes"]
        assert node_nbytes == numel(None) * wire_bytes  # one model's bytes a sync, each byte from one rank of the node
    if name == "fp32":
        assert numel(None) == 3 * result["numel"]  # 3 syncs of the whole model


# -- the Trainer at 2 x 2 -------------------------------------------------------------------------------------------
# the same run as tests/test_diloco_trainer.py's 2 ranks (2 warm-up steps, streaming in 2 fragments, bf16 wire)


def _trainer_state(trainer) -> dict:
    return {"params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]),
            "anchors": torch.cat([a.clone() for a in trainer.diloco.anchors]), "step": trainer.step,
            "inner_step": trainer.diloco.inner_step, "wire_nbytes": trainer.diloco.wire_nbytes,
            "node": dist.get_process_group_ranks(trainer.diloco.node_group)}


def _trainer_scenarios(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    os.environ["GROUP_RANK"] = str(NODE_IDS[rank])  # as lockstep launch / torchrun set it on each node
    straight = _trainer_state(_train(os.path.join(root, "straight"), 14))
    _train(os.path.join(root, "resumed"), 14, crash_at=7)
    resumed_trainer = _train(os.path.join(root, "resumed"), 14, resume=True, seed=50)
    return {"straight": straight, "resumed": _trainer_state(resumed_trainer),
            "resumed_from": str(resumed_trainer.resumed_from)}


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("diloco_nodes_trainer")
    return run_ranks(_trainer_scenarios, world_size=4, args=(str(root),), timeout_s=300)


def test_trainer_at_two_nodes_of_two_resumes_bit_for_bit(trainer_ranks):
    for rank, r in enumerate(trainer_ranks):
        assert r["straight"]["node"] == [2 * (rank // 2), 2 * (rank // 2) + 1]  # the groups came from GROUP_RANK
        assert r["resumed_from"].endswith("ckpt-000000006.pt")
        assert r["straight"]["step"] == r["resumed"]["step"] == r["straight"]["inner_step"] == 14
        assert torch.equal(r["straight"]["params"], r["resumed"]["params"]), rank
        assert torch.equal(r["straight"]["anchors"], r["resumed"]["anchors"]), rank
    first = trainer_ranks[0]["straight"]
    for r in trainer_ranks[1:]:
        assert torch.equal(r["straight"]["anchors"], first["anchors"])
    assert torch.equal(trainer_ranks[0]["straight"]["params"], trainer_ranks[1]["straight"]["params"])  # a node
    assert not torch.equal(first["params"], trainer_ranks[2]["straight"]["params"])  # nodes apart between syncs
    node_nbytes = [trainer_ranks[2 * n]["straight"]["wire_nbytes"] + trainer_ranks[2 * n + 1]["straight"]["wire_nbytes"]
                   for n in (0, 1)]
    assert node_nbytes[0] == node_nbytes[1] > 0
    assert all(0 < r["straight"]["wire_nbytes"] < node_nbytes[0] for r in trainer_ranks)
