"""lockstep's opt-in ``gradient_as_bucket_view=None``: ``param.grad`` is its averaged bucket slot, no copy back.

Every case trains lockstep with ``gradient_as_bucket_view=None`` ("alias"), lockstep's default ("copy":
torch's copies, ``False``) and torch's DDP side by side on the same data
and records every gradient after every backward: at 2 ranks all three must agree bit for bit (max diff
0.0) and in which gradients are None. Then what aliasing changes, on purpose: ``.grad`` shares the bucket's
memory, so a reference kept across steps sees the next step's values (the documented difference), and the
local gradient tensors are gone after backward.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks
from models import Branchy

IMPLS = ("alias", "copy", "torch")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class _WithUnused(nn.Module):
    """``spare`` never takes part (static_graph learns it in the first iteration)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.spare = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


class _HalfUndefined(nn.Module):
    """The bias gets an undefined gradient every other call (its hook fires with no gradient)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, undefined=False):
        out = F.linear(x, self.fc.weight) + self.fc.bias
        return torch._C._functions.UndefinedGrad()(out) if undefined else out


class _Scale(nn.Module):
    """One parameter vector: torch's DDP takes backward(create_graph=True) on this one (not on a Linear)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return (self.p * x).pow(2)


def _model(impl, make, kw):
    import lockstep

    if impl == "torch":
        return nn.parallel.DistributedDataParallel(make(), **kw)
    # "copy": lockstep's default, torch's copies; "alias": the opt-in gradient_as_bucket_view=None.
    return lockstep.DistributedDataParallel(make(), **({**kw, "gradient_as_bucket_view": None} if impl == "alias" else kw))


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _train(impl, rank, make, **kw):
    return _train_with(lambda make_, kw_: _model(impl, make_, kw_), rank, make, **kw)


def _train_with(build, rank, make, kw=None, steps=5, set_to_none=True, zero_every=1, micro=1, synced=1, branch=None, hook=None,
           rank_local=False):
    """``synced`` synchronised backwards per step (accumulation without no_sync), each after ``micro - 1``
    under no_sync; ``zero_grad`` every ``zero_every`` steps; ``rank_local``: each rank scales its .grad
    by its own factor after each step's backward (as per-rank clipping would), so a gradient kept
    through a step differs between ranks. Returns every step's gradients and the state at the end."""
    torch.manual_seed(100 + rank)  # a different init on every rank: the start-up broadcast matters
    torch.manual_seed(torch.initial_seed())
    model = build(make, kw or {})
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_step = []
    for step in range(steps):
        if step % zero_every == 0:
            opt.zero_grad(set_to_none=set_to_none)
        for s in range(synced):
            for m in range(micro):
                gen = torch.Generator().manual_seed(1000 * step + 100 * s + 10 * m + rank)
                x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
                kwargs = branch(step, rank, m) if branch else {}
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    F.cross_entropy(model(x, **kwargs), y).backward()
        per_step.append(_grads(model))
        if rank_local:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 + rank)
        opt.step()
    return {"grads": per_step, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _side_by_side(rank, **kw):
    return {impl: _train(impl, rank, **kw) for impl in IMPLS}


def _branch_changes(step, rank, m):
    # step 1: b on rank 0 only; step 2: a everywhere (b unused on every rank while its .grad holds step 1's
    # average when zero_grad is skipped); step 3: b everywhere.
    return {"branch": {0: "a", 1: "b" if rank == 0 else "a", 2: "a", 3: "b"}.get(step, "a" if (step + m) % 2 else "b")}


def _hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}


def _training_cases(rank, side_by_side=None, create_graph=None, impls=IMPLS):
    """Every training case, each run side by side by ``side_by_side(rank, **case)`` (test_direct_buckets reuses them)."""
    run = side_by_side or _side_by_side
    create_graph = create_graph or _create_graph
    cases = {}
    for stn in (True, False):
        cases[f"plain_{stn}"] = run(rank, make=_Net, set_to_none=stn)
        cases[f"nosync_{stn}"] = run(rank, make=_Net, set_to_none=stn, micro=3)
        cases[f"accumulate_{stn}"] = run(rank, make=_Net, set_to_none=stn, synced=2, zero_every=2)
        cases[f"unused_{stn}"] = run(rank, make=Branchy, kw={"find_unused_parameters": True}, set_to_none=stn,
                                               branch=_branch_changes, steps=6)
        cases[f"unused_nosync_{stn}"] = run(rank, make=Branchy, kw={"find_unused_parameters": True},
                                                      set_to_none=stn, branch=_branch_changes, micro=2, steps=6)
        cases[f"static_{stn}"] = run(rank, make=_WithUnused, kw={"static_graph": True}, set_to_none=stn)
        cases[f"undefined_{stn}"] = run(rank, make=_HalfUndefined, kw={"find_unused_parameters": True},
                                                  set_to_none=stn, zero_every=3, branch=lambda s, r, m: {"undefined": s % 2 == 1})
        cases[f"rebuild_small_buckets_{stn}"] = run(rank, make=_Net, kw={"bucket_cap_mb": 0.001}, set_to_none=stn)
    # No zero_grad at all: unused parameters keep accumulated values across steps.
    cases["unused_never_zeroed"] = run(rank, make=Branchy, kw={"find_unused_parameters": True},
                                                 set_to_none=False, zero_every=100, branch=_branch_changes, steps=6)
    # Per-rank .grad values kept through a step where no rank uses the parameter: torch leaves each rank's
    # own value (the slot's reduced value must not replace it; at 2 ranks only differing values tell).
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        make, branch = (Branchy, _branch_changes) if "find_unused_parameters" in kw else (_WithUnused, None)
        cases[f"rank_local_{next(iter(kw))}"] = run(rank, make=make, kw=kw, set_to_none=False, zero_every=100,
                                                              branch=branch, steps=6, rank_local=True)
    cases["create_graph"] = {impl: create_graph(rank, impl) for impl in impls}
    for name, hook in _hooks().items():
        cases[f"hook_{name}"] = run(rank, make=_Net, hook=hook, set_to_none=False)
    return cases


def _create_graph(rank, impl):
    return _create_graph_steps(rank, lambda make, kw: _model(impl, make, kw))


def _create_graph_steps(rank, build):
    """backward(create_graph=True), accumulated (torch's DDP fails an optimizer step in between here): the
    averages go into the graph-carrying .grad with a recorded copy_, in every mode (today's path)."""
    import warnings

    torch.manual_seed(3)
    model = build(_Scale, {})
    per_step = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).sum().backward(create_graph=True)
            per_step.append(_grads(model) + [torch.tensor([float(p.grad.requires_grad) for p in model.parameters()])])
    return {"grads": per_step, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _join(rank, impl):
    return _join_with(rank, lambda make, kw: _model(impl, make, kw))


def _join_with(rank, build):
    """Uneven inputs: rank 0 runs out first; its .grad after the others' shadowed rounds must be untouched."""
    torch.manual_seed(7)
    model = build(_Net, {})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    with model.join():
        for _ in range(3 + 2 * rank):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(4, 8, generator=gen)), torch.randint(0, 4, (4,), generator=gen)).backward()
            opt.step()
        grads_at_join = _grads(model)
    return {"at_join": grads_at_join, "after": _grads(model), "state": [t.clone() for t in model.state_dict().values()]}


def _aliasing(rank):
    """What aliasing changes: where .grad lives, a kept reference, memory, the logging data."""
    import lockstep

    out = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model = _model(impl, _Net, {})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kept, seen = None, []
        for step in range(3):
            opt.zero_grad()  # set_to_none=True: the reference below survives it
            gen = torch.Generator().manual_seed(10 * step + rank)
            F.cross_entropy(model(torch.randn(4, 8, generator=gen)), torch.randint(0, 4, (4,), generator=gen)).backward()
            if step == 1:
                kept = model.module.fc1.weight.grad
                seen.append(kept.clone())
            if step == 2:
                seen.append(kept.clone())
                seen.append(model.module.fc1.weight.grad.clone())
            opt.step()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        record = {"kept": seen, "grad_storages": len(storages)}
        if impl != "torch":
            record["bucket_storages"] = len(model.reducer.buckets)
            record["in_buckets"] = storages == {b.buffer.untyped_storage().data_ptr() for b in model.reducer.buckets}
        record["logging"] = {k: model._get_ddp_logging_data().get(k) for k in ("gradient_as_bucket_view", "grads_alias_buckets")}
        record["attr"] = model.gradient_as_bucket_view
        out[impl] = record
    view = lockstep.DistributedDataParallel(_Net(), gradient_as_bucket_view=True)
    out["view_logging"] = {k: view._get_ddp_logging_data().get(k) for k in ("gradient_as_bucket_view", "grads_alias_buckets")}
    checked = lockstep.DistributedDataParallel(_Net(), gradient_as_bucket_view=None, detect_nonfinite=True)  # copies: its error comes before .grad
    out["nonfinite_aliases"] = checked._get_ddp_logging_data()["grads_alias_buckets"]
    # The first step: no .grad before it; after it, every .grad is its bucket slot.
    first = lockstep.DistributedDataParallel(_Net(), gradient_as_bucket_view=None)
    before = [p.grad is None for p in first.parameters()]
    first(torch.randn(2, 8)).sum().backward()
    slots = {id(v): v for b in first.reducer.buckets for v in b.views}
    out["first_step"] = {"none_before": all(before),
                         "slot_after": all(p.grad.data_ptr() == v.data_ptr() and p.grad._base is b.buffer
                                           for b in first.reducer.buckets for p, v in zip(b.params, b.views)),
                         "slots": len(slots)}
    return out


def _all_cases(rank, world_size):
    return {"training": _training_cases(rank), "join": {impl: _join(rank, impl) for impl in IMPLS}, "aliasing": _aliasing(rank)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=400)


def _same(a, b) -> bool:
    """Bit-identical lists of gradients (None where None)."""
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


TRAINING = [f"{c}_{stn}" for c in ("plain", "nosync", "accumulate", "unused", "unused_nosync", "static", "undefined",
                                   "rebuild_small_buckets") for stn in (True, False)]
TRAINING += ["rank_local_find_unused_parameters", "rank_local_static_graph", "unused_never_zeroed", "create_graph", "hook_allreduce", "hook_fp16"]


@pytest.mark.parametrize("case", TRAINING)
def test_gradients_bit_identical_to_torch_every_step(results, case):
    for rank in range(2):
        runs = results[rank]["training"][case]
        for impl in ("alias", "copy"):
            for step, (ours, theirs) in enumerate(zip(runs[impl]["grads"], runs["torch"]["grads"])):
                assert _same(ours, theirs), f"{case} {impl} rank {rank} step {step}"
            assert runs[impl]["state"].keys() == runs["torch"]["state"].keys()
            assert all(torch.equal(runs[impl]["state"][k], v) for k, v in runs["torch"]["state"].items()), (case, impl)


def test_unused_parameters_keep_their_grad_as_torch(results):
    # Step 2 of _branch_changes: head b unused on every rank; without zero_grad its .grad still holds
    # step 1's average in torch, and so in lockstep, whose slot for it was reduced meanwhile (zeros).
    runs = results[0]["training"]["unused_never_zeroed"]
    b_weight, b_bias = 4, 5  # trunk.weight, trunk.bias, a.weight, a.bias, b.weight, b.bias
    for impl in IMPLS:
        grads = runs[impl]["grads"]
        assert grads[0][b_weight] is None  # step 0: nobody used b
        assert grads[1][b_weight].abs().sum() > 0
        assert torch.equal(grads[2][b_weight], grads[1][b_weight]) and torch.equal(grads[2][b_bias], grads[1][b_bias])


def test_join_leaves_the_joined_ranks_grads_as_torch(results):
    for rank in range(2):
        runs = results[rank]["join"]
        for impl in ("alias", "copy"):
            assert _same(runs[impl]["after"], runs["torch"]["after"]), (rank, impl)
            assert all(torch.equal(a, b) for a, b in zip(runs[impl]["state"], runs["torch"]["state"]))
    # rank 0 joined first and shadowed rank 1's last rounds: its gradients are those of its own last step
    assert _same(results[0]["join"]["alias"]["after"], results[0]["join"]["alias"]["at_join"])


def test_grads_live_in_the_buckets_with_none(results):
    a = results[0]["aliasing"]
    assert a["alias"]["in_buckets"] and a["alias"]["grad_storages"] == a["alias"]["bucket_storages"]
    assert not a["copy"]["in_buckets"] and a["copy"]["grad_storages"] == 6
    assert a["torch"]["grad_storages"] == 6
    assert a["first_step"] == {"none_before": True, "slot_after": True, "slots": 6}


def test_a_kept_reference_sees_the_next_step_with_none_only(results):
    for rank in range(2):
        a = results[rank]["aliasing"]
        step1, kept_at_2, step2 = a["alias"]["kept"]
        assert torch.equal(kept_at_2, step2) and not torch.equal(step1, step2)  # the documented difference
        for impl in ("copy", "torch"):
            step1, kept_at_2, step2 = a[impl]["kept"]
            assert torch.equal(kept_at_2, step1) and not torch.equal(step1, step2)
        assert torch.equal(a["alias"]["kept"][2], a["torch"]["kept"][2])


def test_logging_data_reports_the_argument_as_torch(results):
    a = results[0]["aliasing"]
    assert a["torch"]["logging"]["gradient_as_bucket_view"] == 0
    assert a["alias"]["logging"] == {"gradient_as_bucket_view": 0, "grads_alias_buckets": 1}  # None: falsy, as torch reads it
    assert a["copy"]["logging"] == {"gradient_as_bucket_view": 0, "grads_alias_buckets": 0}
    assert a["view_logging"] == {"gradient_as_bucket_view": 1, "grads_alias_buckets": 1}
    assert a["nonfinite_aliases"] == 0
    assert a["alias"]["attr"] is None and a["copy"]["attr"] is False and a["torch"]["attr"] is False
