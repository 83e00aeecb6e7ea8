"""ZeRO-1 on lockstep's DDP, on 2 gloo ranks, bit for bit.

torch's ZeroRedundancyOptimizer over lockstep's DDP gives the parameters torch's DDP with the same optimizer gives;
the test also checks that the state really is sharded (no rank holds all of it), so a ZeroRedundancyOptimizer that
fell back to a plain optimizer could not pass.

lockstep's own ``lockstep.ZeroRedundancyOptimizer`` (issue #36 item 2), 50 steps of SGD with momentum, Adam and
AdamW, foreach on and off, parameters as bucket views or not: the parameters equal torch's ZeroRedundancyOptimizer's
and a plain optimizer's under lockstep's DDP, bit for bit; its consolidated ``state_dict`` equals torch's class's
(and loads into a plain optimizer), and a plain optimizer's state loads into it and trains on identically; the
shards travel in fewer broadcasts than torch's. One spawned group (~60 s on 2 cores).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from dist_utils import run_ranks
from lockstep import DistributedDataParallel as LockstepDDP
from lockstep import ZeroRedundancyOptimizer as LockstepZero

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
    return {"torch_zero_over_lockstep_ddp": _torch_zero_cases(rank), "lockstep_zero": _lockstep_zero_cases(rank)}


def _torch_zero_cases(rank):
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
def all_results():
    return run_ranks(_case, 2, timeout_s=300)


def test_lockstep_ddp_with_zero_redundancy_optimizer_equals_torch_ddp(all_results):
    results = [r["torch_zero_over_lockstep_ddp"] for r in all_results]
    for rank, per_rank in enumerate(results):
        for key, r in per_rank.items():
            assert all(r["equal"]), f"rank {rank}, (parameters_as_bucket_view, bucket_cap_mb)={key}: {r['equal']}"
            assert r["moved"]  # the optimizer did step
            ours, theirs = r["shards"]
            assert ours == theirs and 0 < ours < r["nparams"]  # sharded: each rank holds part of the state
    for key in results[0]:
        assert results[0][key]["shards"][0] + results[1][key]["shards"][0] == results[0][key]["nparams"]


# ---- lockstep.ZeroRedundancyOptimizer
LONG_STEPS = 50
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
}


def _run(rank: int, make_optimizer, steps: int = LONG_STEPS, model=None, opt=None):
    """``steps`` steps on lockstep's DDP, each rank its own data; returns (parameters, model, optimizer)."""
    model = model or LockstepDDP(_model())
    opt = opt or make_optimizer(model.parameters())
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()], model, opt


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_state(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or sorted(a["state"]) != sorted(b["state"]):
        return False
    return all(torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(b["state"][i][k]))
               for i in a["state"] for k in a["state"][i])


def _count_collectives(fn):
    """(result of fn(), {collective: calls}) for the collectives a ZeroRedundancyOptimizer issues."""
    import torch.distributed as dist

    names = ("broadcast", "all_gather", "all_gather_into_tensor")
    counts = dict.fromkeys(names, 0)
    saved = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, counting(n))
    try:
        return fn(), counts
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _exactness(rank):
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for foreach in (False, True):
            for view in (False, True):
                kw = {**kwargs, "foreach": foreach}
                ours, _, _ = _run(rank, lambda ps: LockstepZero(ps, optimizer_class=cls, parameters_as_bucket_view=view, **kw))
                theirs, _, _ = _run(rank, lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=cls,
                                                                           parameters_as_bucket_view=view, **kw))
                plain, _, _ = _run(rank, lambda ps: cls(ps, **kw))
                out[(name, foreach, view)] = {"vs_torch_zero": _same(ours, theirs), "vs_plain": _same(ours, plain),
                                              "moved": not _same(ours, [p.detach() for p in _model().parameters()])}
    return out


def _checkpoints(rank):
    """state_dict against torch's class; a plain AdamW's state into lockstep's class and on, and back."""
    def ours(ps):
        return LockstepZero(ps, optimizer_class=torch.optim.AdamW, lr=1e-3)

    def theirs(ps):
        return ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=1e-3)

    _, model, zero = _run(rank, ours, steps=5)
    _, _, tzero = _run(rank, theirs, steps=5)
    for opt in (zero, tzero):
        opt.consolidate_state_dict(to=0)
    out = {"equal_to_torch": _same_state(zero.state_dict(), tzero.state_dict()) if rank == 0 else None}
    if rank == 1:
        try:
            zero.state_dict()
        except RuntimeError as e:
            out["not_consolidated"] = str(e)
    # A plain AdamW's checkpoint resumed by lockstep's class, and lockstep's resumed by a plain AdamW: 5 more steps
    # each, against the plain optimizer that never stopped.
    _, pmodel, plain = _run(rank, lambda ps: torch.optim.AdamW(ps, lr=1e-3), steps=5)
    saved = copy.deepcopy(plain.state_dict())  # its tensors are the live state, which the next steps update
    reference, _, _ = _run(rank, None, steps=5, model=pmodel, opt=plain)
    _, model2, _ = _run(rank, lambda ps: torch.optim.AdamW(ps, lr=1e-3), steps=5)
    resumed_zero = ours(model2.parameters())
    resumed_zero.load_state_dict(saved)
    resumed, _, _ = _run(rank, None, steps=5, model=model2, opt=resumed_zero)
    out["plain_into_zero"] = _same(resumed, reference)
    out["input_unchanged"] = all(v is not None for v in saved["state"].values())
    if rank == 0:
        plain2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plain2.load_state_dict(zero.state_dict())
        out["zero_into_plain"] = _same_state(plain2.state_dict(), zero.state_dict())
    return out


def _by_keyword(rank):
    """Every argument by keyword, ``params=`` too, as torch's class takes them: the same bits as torch's built so."""
    kwargs = dict(optimizer_class=torch.optim.AdamW, process_group=None, parameters_as_bucket_view=False,
                  overlap_with_ddp=False, lr=1e-3)
    ours, _, _ = _run(rank, lambda ps: LockstepZero(params=ps, **kwargs), steps=3)
    theirs, _, _ = _run(rank, lambda ps: ZeroRedundancyOptimizer(params=ps, **kwargs), steps=3)
    return _same(ours, theirs)


def _lockstep_zero_cases(rank):
    out = {"exact": _exactness(rank), "checkpoints": _checkpoints(rank), "slices": _slices(rank),
           "by_keyword": _by_keyword(rank)}
    for view in (False, True):  # over torch's DDP too, as a drop-in for torch's class
        ours, _, _ = _run(rank, lambda ps: LockstepZero(ps, optimizer_class=torch.optim.AdamW, lr=1e-3,
                                                        parameters_as_bucket_view=view), steps=10, model=TorchDDP(_model()))
        theirs, _, _ = _run(rank, lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=1e-3,
                                                                     parameters_as_bucket_view=view), steps=10,
                            model=TorchDDP(_model()))
        out[("over_torch_ddp", view)] = _same(ours, theirs)
    for view in (False, True):
        counts = []
        for cls in (LockstepZero, ZeroRedundancyOptimizer):
            model = LockstepDDP(_model())
            opt = cls(model.parameters(), optimizer_class=torch.optim.SGD, lr=1e-2, parameters_as_bucket_view=view)
            model(torch.randn(8, 16)).sum().backward()
            counts.append(_count_collectives(opt.step)[1])  # the step alone: DDP's own collectives are not counted
        out[("collectives", view)] = tuple(counts)
    return out


def _odd_model() -> torch.nn.Module:
    """_model() with one non-contiguous parameter (a transposed weight)."""
    model = _model()
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().t().contiguous().t())
    assert not model[2].weight.is_contiguous()
    return model


def _slices(rank):
    """DIRECT_BYTES and COALESCE_BYTES so small that some parameters travel alone and the others in several
    groups (one of them non-contiguous): the same bits as torch's class, or as a plain AdamW where torch's cannot
    broadcast a non-contiguous parameter."""
    import lockstep.optim.zero as zero

    saved = zero.DIRECT_BYTES, zero.COALESCE_BYTES
    zero.DIRECT_BYTES, zero.COALESCE_BYTES = 1024, 300  # the weights alone, the biases in groups of <= 75 floats
    out = {}
    try:
        for view in (False, True):
            ours, _, opt = _run(rank, lambda ps: LockstepZero(ps, optimizer_class=torch.optim.AdamW, lr=1e-3,
                                                            parameters_as_bucket_view=view), steps=10)
            theirs, _, topt = _run(rank, lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW,
                                                                           lr=1e-3, parameters_as_bucket_view=view), steps=10)
            shard = [id(p) for p in opt.optim.param_groups[0]["params"]]
            order = [i for i, p in enumerate(opt.param_groups[0]["params"]) if id(p) in shard]
            out[view] = {"vs_torch": _same(ours, theirs), "order": order == sorted(order),
                         "same_shard": len(topt.optim.param_groups[0]["params"]) == len(shard)}
            # The same data on both ranks and no DDP: the gradients agree without one, so a plain AdamW is the reference.
            g = torch.Generator().manual_seed(7)
            models = [_odd_model(), _odd_model()]
            opts = [LockstepZero(models[0].parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                 parameters_as_bucket_view=view), torch.optim.AdamW(models[1].parameters(), lr=1e-2)]
            for _ in range(5):
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                for model, opt_ in zip(models, opts):
                    opt_.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt_.step()
            out[view]["non_contiguous"] = _same(list(models[0].parameters()), list(models[1].parameters()))
    finally:
        zero.DIRECT_BYTES, zero.COALESCE_BYTES = saved
    return out


def test_parameters_alone_and_in_groups(all_results):
    for rank, r in enumerate(all_results):
        for view, cell in r["lockstep_zero"]["slices"].items():
            assert cell["vs_torch"], f"rank {rank}, parameters_as_bucket_view={view}: != torch's class"
            assert cell["non_contiguous"], f"rank {rank}, parameters_as_bucket_view={view}: a non-contiguous parameter"
            assert cell["same_shard"] and cell["order"], cell  # torch's shard, in the model's order


def test_lockstep_zero_is_bit_for_bit_torch_zero_and_a_plain_optimizer(all_results):
    for rank, r in enumerate(all_results):
        for key, cell in r["lockstep_zero"]["exact"].items():
            assert cell["moved"], key
            assert cell["vs_torch_zero"], f"rank {rank} (optimizer, foreach, parameters_as_bucket_view)={key}: != torch's"
            assert cell["vs_plain"], f"rank {rank} {key}: != the plain optimizer under lockstep's DDP"
    assert len(all_results[0]["lockstep_zero"]["exact"]) == 12


def test_lockstep_zero_checkpoints(all_results):
    rank0, rank1 = (r["lockstep_zero"]["checkpoints"] for r in all_results)
    assert rank0["equal_to_torch"], "consolidated state_dict differs from torch's ZeroRedundancyOptimizer's"
    assert rank0["zero_into_plain"]
    assert rank0["plain_into_zero"] and rank1["plain_into_zero"]
    assert rank0["input_unchanged"] and rank1["input_unchanged"]  # torch's class sets other ranks' entries to None
    assert "consolidate_state_dict(to=1)" in rank1["not_consolidated"]


def test_lockstep_zero_issues_fewer_collectives(all_results):
    for view in (False, True):
        ours, theirs = all_results[0]["lockstep_zero"][("collectives", view)]
        assert ours["broadcast"] == 2 and ours["all_gather"] == ours["all_gather_into_tensor"] == 0, ours
        assert theirs["broadcast"] == (2 if view else 6), theirs  # one per rank, or one per parameter
    # Without bucket views: this small model's parameters (all under DIRECT_BYTES) go in one buffer a rank


def test_lockstep_zero_takes_every_argument_by_keyword_as_torchs_class(all_results):
    # the same names, kinds and defaults as torch's signature, so any call torch's class takes is taken here
    ours, theirs = (inspect.signature(cls).parameters.values() for cls in (LockstepZero, ZeroRedundancyOptimizer))
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]
    assert all(r["lockstep_zero"]["by_keyword"] for r in all_results)  # params=..., optimizer_class=...: torch's bits


def test_overlap_with_ddp_is_refused_in_one_line():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="overlap_with_ddp=True") as info:
        LockstepZero(params, optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    assert "\n" not in str(info.value) and "overlap_with_ddp=False" in str(info.value)


def test_memory_benchmark_zero_table_from_given_numbers():
    """benchmarks/memory.py --zero's table: each cell less the measured activations, the ratio to lockstep's DDP +
    AdamW, bytes a parameter, and whether the goal ((8 + 8/N)/16, below torch's ZeRO) is met."""
    import argparse
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        import memory
    finally:
        sys.path.remove(bench)
    mb = {"lockstep DDP + AdamW": 840, "lockstep DDP + lockstep ZeRO-1": 602, "lockstep DDP + lockstep ZeRO-1, bucket view": 600,
          "torch DDP + torch ZeRO-1": 860, "torch DDP + torch ZeRO-1, bucket view": 850, "torch DDP + AdamW": 1040,
          "no DDP, no optimizer state (activations)": 402}
    cells = {name: [{"added_bytes": v * 1e6}, {"added_bytes": (v - 1) * 1e6}] for name, v in mb.items()}
    report = {"backend": "gloo", "models": {"mlp": {"params": 50_000_000, "grad_bytes": 200e6, "zero": cells}}}
    text = memory.zero_markdown(report, argparse.Namespace(world_size=2, device="cpu"))
    assert "(8 + 8/N)/16 = 0.750" in text and "activations 2.0 MB" in text
    assert "| lockstep DDP + lockstep ZeRO-1 | 600 | 0.716 | 12.0 |" in text  # 602 - 2 MB of activations, / 838
    assert "0.716 of lockstep's DDP + AdamW (goal <= 0.750: met)" in text and "598 MB against torch's best 848 MB (below)" in text
    cells["lockstep DDP + lockstep ZeRO-1"] = [{"added_bytes": 700e6}]
    assert "NOT met" in memory.zero_markdown(report, argparse.Namespace(world_size=2, device="cpu"))


def test_lockstep_zero_over_torch_ddp_equals_torch_zero(all_results):
    for rank, r in enumerate(all_results):
        for view in (False, True):
            assert r["lockstep_zero"][("over_torch_ddp", view)], f"rank {rank}, parameters_as_bucket_view={view}"
