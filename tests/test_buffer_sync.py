"""Buffers broadcast while the forward runs (``lockstep.ddp.buffer_sync``), against torch's DDP.

Where only normalisation layers own the synchronised buffers, the broadcast of rank 0's buffers
is waited for just before the first such layer runs. These cases check that it really is (the
stem convolution still sees this rank's own buffers, the BatchNorm rank 0's), that training and
evaluation equal torch's DDP bit for bit, that any other owner of a buffer, or join, waits before
the forward as torch does, that a forward that raises leaves the group usable, and the documented
difference: a parent reading a BatchNorm buffer before that layer ran sees its own rank's value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks


class _Stem(nn.Module):
    """conv -> BN -> conv -> BN -> head; records, per forward, what the stem conv and the first BN saw."""

    def __init__(self, extra_buffer: bool = False, peek: bool = False, fail: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)
        if extra_buffer:
            self.table = _Table()
        self.peek, self.fail = peek, fail
        self.seen: list[tuple[float, float, float | None]] = []
        self.conv.register_forward_pre_hook(lambda m, a: self._note("conv"))
        self.bn.register_forward_pre_hook(lambda m, a: self._note("bn"))

    def _note(self, where):
        self._last = getattr(self, "_last", {})
        self._last[where] = self.bn.running_mean.sum().item()

    def forward(self, x):
        peeked = self.bn.running_mean.sum().item() if self.peek else None
        if self.fail:
            raise ValueError("failing forward")
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        if hasattr(self, "table"):
            h = h + self.table.offset.view(1, -1, 1, 1)
        self.seen.append((self._last["conv"], self._last["bn"], peeked))
        return self.head(h.mean((2, 3)))


class _Table(nn.Module):
    """A module that owns a buffer and is not a normalisation layer: its reads cannot be waited for."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.zeros(8))


def _train(cls_name, rank, steps=4, **model_kwargs):
    import lockstep

    cls = lockstep.DistributedDataParallel if cls_name == "lockstep" else nn.parallel.DistributedDataParallel
    torch.manual_seed(0)
    module = _Stem(**model_kwargs)
    model = cls(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if hasattr(module, "table"):
            module.table.offset.add_(rank + 1)  # ranks drift apart: the next forward must bring rank 0's back
    model.eval()
    with torch.no_grad():
        evaluated = model(torch.randn(4, 3, 8, 8, generator=g))  # running statistics: rank 0's
    state = {k: v.clone() for k, v in module.state_dict().items()}
    return {"state": state, "eval": evaluated, "seen": list(module.seen)}


def _deferred(rank):
    """Which forwards deferred: count the broadcasts that were pending when the forward began."""
    import lockstep
    from lockstep.ddp import buffer_sync

    made = []
    real = buffer_sync.PendingBuffers.__init__

    def counting(self, *args):
        made.append(1)
        real(self, *args)

    buffer_sync.PendingBuffers.__init__ = counting
    try:
        out = {}
        for name, kwargs in {"bn_only": {}, "extra_buffer": {"extra_buffer": True}}.items():
            made.clear()
            torch.manual_seed(0)
            model = lockstep.DistributedDataParallel(_Stem(**kwargs))
            for _ in range(3):
                model(torch.randn(2, 3, 8, 8)).sum().backward()
            out[name] = len(made)
        made.clear()
        torch.manual_seed(0)
        compiled = _Stem()
        compiled.bn2 = torch.compile(compiled.bn2, backend="eager")  # a compiled submodule: waited for first
        model = lockstep.DistributedDataParallel(compiled)
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
        out["compiled_submodule"] = len(made)
        made.clear()
        torch.manual_seed(0)
        model = lockstep.DistributedDataParallel(_Stem())
        with model.join():
            for _ in range(2):
                model(torch.randn(2, 3, 8, 8)).sum().backward()
        out["join"] = len(made)
        out["hooks_left"] = len(torch.nn.modules.module._global_forward_pre_hooks)
        return out
    finally:
        buffer_sync.PendingBuffers.__init__ = real


def _failing_forward(rank):
    import lockstep

    torch.manual_seed(0)
    module = _Stem()
    model = lockstep.DistributedDataParallel(module)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    with torch.no_grad():
        module.bn.running_mean.fill_(float(rank))  # rank 1's differ from rank 0's
    module.fail = True
    try:
        model(torch.randn(2, 3, 8, 8))
        error = None
    except ValueError as exc:
        error = str(exc)
    module.fail = False
    after_failure = module.bn.running_mean.sum().item()  # the broadcast was finished anyway: rank 0's zeros
    t = torch.ones(1)
    dist.all_reduce(t)
    model(torch.randn(2, 3, 8, 8)).sum().backward()  # and training goes on
    return {"error": error, "after_failure": after_failure, "alive": t.item(),
            "hooks_left": len(torch.nn.modules.module._global_forward_pre_hooks)}


def _no_buffers(rank):
    """A module without buffers: not walked after its first forward; a buffer registered later is still broadcast."""
    import lockstep

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = lockstep.DistributedDataParallel(module)
    walks = []
    real = module.named_modules

    def counting(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)

    module.named_modules = counting  # an instance attribute: this module's walks only
    try:
        model(torch.randn(2, 4)).sum().backward()  # the first forward walks it (and checks the replicas)
        walks.clear()
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
        out = {"walks": len(walks)}
        module[0].register_buffer("scale", torch.full((4,), float(rank + 1)))  # each rank its own
        model(torch.randn(2, 4)).sum().backward()
        out["walks_after_register"] = len(walks)
        out["scale"] = module[0].scale.tolist()
        return out
    finally:
        del module.named_modules


def _cases(rank, world_size):
    return {
        "no_buffers": _no_buffers(rank),
        "bn": {impl: _train(impl, rank) for impl in ("lockstep", "torch")},
        "extra": {impl: _train(impl, rank, extra_buffer=True) for impl in ("lockstep", "torch")},
        "peek": {impl: _train(impl, rank, peek=True) for impl in ("lockstep", "torch")},
        "deferred": _deferred(rank),
        "failing": _failing_forward(rank),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 2, timeout_s=180)


@pytest.mark.parametrize("case", ["bn", "extra", "peek"])
def test_training_and_evaluation_equal_torchs_ddp(results, case):
    for rank in range(2):
        ours, theirs = results[rank][case]["lockstep"], results[rank][case]["torch"]
        assert set(ours["state"]) == set(theirs["state"])
        assert all(torch.equal(ours["state"][k], theirs["state"][k]) for k in ours["state"]), case
        assert torch.equal(ours["eval"], theirs["eval"]), case
    assert all(torch.equal(results[0]["bn"]["lockstep"]["state"][k], v) for k, v in results[1]["bn"]["lockstep"]["state"].items())


def test_the_broadcast_overlaps_the_stem_and_lands_before_the_batchnorm(results):
    # Rank 1, training forwards after the first: its stem conv runs with its own running mean (the previous
    # step's), its BatchNorm with rank 0's, which torch's DDP gives both of them.
    ours, theirs = results[1]["bn"]["lockstep"]["seen"], results[1]["bn"]["torch"]["seen"]
    for step in range(1, 4):
        conv_saw, bn_saw, _ = ours[step]
        assert bn_saw == theirs[step][1]  # what the layer reads: the same as torch's
        assert conv_saw != bn_saw  # the bytes arrived between the two: the broadcast overlapped the stem conv
        assert theirs[step][0] == theirs[step][1]  # torch's waited before the forward
    for step in range(1, 4):  # rank 0 is the source: nothing changes under it
        assert results[0]["bn"]["lockstep"]["seen"][step][0] == results[0]["bn"]["lockstep"]["seen"][step][1]


def test_a_parent_peeking_before_the_layer_sees_its_own_rank(results):
    # The documented difference: read in the parent's forward before the BatchNorm ran, rank 1 sees its own
    # previous value where torch's DDP has already put rank 0's there.
    ours, theirs = results[1]["peek"]["lockstep"]["seen"], results[1]["peek"]["torch"]["seen"]
    assert any(o[2] != t[2] for o, t in zip(ours[1:4], theirs[1:4]))
    assert all(o[1] == t[1] for o, t in zip(ours, theirs))  # the layer itself still reads rank 0's


def test_only_normalisation_owners_defer_and_join_and_compile_wait_first(results):
    for rank in range(2):
        d = results[rank]["deferred"]
        assert d["bn_only"] == 3  # every synchronised forward
        assert d["extra_buffer"] == 0  # a buffer of another module: waited for before the forward, as torch
        assert d["join"] == 0
        assert d["compiled_submodule"] == 0
        assert d["hooks_left"] == 0  # the pre-hook is gone once each broadcast landed


def test_a_forward_that_raises_still_finishes_the_broadcast(results):
    for rank in range(2):
        f = results[rank]["failing"]
        assert f["error"] == "failing forward"
        assert f["after_failure"] == 0.0  # rank 0's zeros, on rank 1 too
        assert f["alive"] == 2.0 and f["hooks_left"] == 0


def test_a_module_without_buffers_is_walked_once_and_a_later_buffer_still_syncs(results):
    for rank in range(2):
        case = results[rank]["no_buffers"]
        assert case["walks"] == 0, case  # the old tree walked at every forward (3)
        assert case["walks_after_register"] == 1, case  # the registration made the next forward look again
        assert case["scale"] == [1.0] * 4, case  # rank 0's, on rank 1 too
