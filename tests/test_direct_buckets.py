"""Direct buckets: a large parameter's gradient all-reduced where autograd left it (``lockstep.ddp.copy_in``).

With ``gradient_as_bucket_view=False`` (the default) a CPU parameter of at least
``DistributedDataParallel.direct_min_bytes`` (4 MiB) gets a bucket of its own, and its all-reduce runs
on ``.grad`` itself, scaled in place: no copy in, no copy back. The test models are small, so a subclass
sets ``direct_min_bytes = 1`` (every parameter but those in the last bucket goes direct), beside
lockstep with direct buckets off and torch's DDP, trained side by side: every gradient after every
backward must be bit-identical (max diff 0.0) at 2 ranks, in every mode of training that torch's
DDP has. Then what must hold besides the values: the direct path is really taken (and not where it
would be unsafe), ``.grad`` stays autograd's own tensor, a user's post-accumulate-grad hook still sees
the local gradient, and a dropped ``.grad`` is freed by the next backward rather than held by a work.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks
from test_grad_alias import TRAINING, _Net, _create_graph_steps, _join_with, _same, _train_with
from test_grad_alias import _training_cases as alias_training_cases

IMPLS = ("direct", "plain", "torch")


def _make_model(impl, module, kw):
    import lockstep

    class Direct(lockstep.DistributedDataParallel):
        direct_min_bytes = 1

    class Plain(lockstep.DistributedDataParallel):
        direct_min_bytes = None

    cls = {"direct": Direct, "plain": Plain, "torch": nn.parallel.DistributedDataParallel}[impl]
    return cls(module, **kw)


def _side_by_side(rank, **kw):
    out = {}
    for impl in IMPLS:
        run = _train_with(lambda make, kw_: _make_model(impl, make(), kw_), rank, **kw)
        out[impl] = run
    return out


def _training_cases(rank):
    """test_grad_alias's cases, with direct buckets, copies and torch's DDP side by side."""
    return alias_training_cases(
        rank, side_by_side=_side_by_side, impls=IMPLS,
        create_graph=lambda r, impl: _create_graph_steps(r, lambda make, kw_: _make_model(impl, make(), kw_)))


def _join(rank, impl):
    return _join_with(rank, lambda make, kw: _make_model(impl, make(), kw))


def _one_step(model, rank, step):
    gen = torch.Generator().manual_seed(10 * step + rank)
    F.cross_entropy(model(torch.randn(4, 8, generator=gen)), torch.randint(0, 4, (4,), generator=gen)).backward()


def _behaviour(rank):
    """What must hold besides the values."""
    out = {}
    # The path is taken: every bucket but the last one (which carries the status flag) runs direct.
    model = _make_model("direct", _Net(), {})
    _one_step(model, rank, 0)
    out["layout"] = [(b.plan.direct, len(b.params)) for b in model.reducer.buckets]
    out["direct_launches"] = model.reducer.direct_launches
    buffers = {b.buffer.untyped_storage().data_ptr() for b in model.reducer.buckets}
    out["grads_outside_buckets"] = all(p.grad.untyped_storage().data_ptr() not in buffers for p in model.parameters())
    # A reference kept across steps keeps its values (it is autograd's tensor, as in torch's default).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()
    _one_step(model, rank, 1)
    kept = model.module.fc2.weight.grad  # a direct one: its step's work holds it too
    kept_ref = weakref.ref(kept)
    del kept
    opt.step()
    opt.zero_grad()  # drops .grad: only the step's work still holds it, until the next backward
    _one_step(model, rank, 2)
    gc.collect()
    out["dropped_grad_freed"] = kept_ref() is None
    # Not direct where it would be unsafe: a hook that may use its buffer later, the NaN check after the all-reduce or with a hook.
    import lockstep

    checked = _make_model("direct", _Net(), {"detect_nonfinite": True})
    _one_step(checked, rank, 0)
    out["nonfinite_direct"] = checked.reducer.direct_launches  # 2 ranks: checked in the scaling pass
    checked_after = _make_model("direct", _Net(), {"detect_nonfinite": True})
    checked_after.reducer.nonfinite.pre_launch = False  # as at 3 ranks: it reads the local gradients afterwards
    _one_step(checked_after, rank, 0)
    out["nonfinite_after_direct"] = checked_after.reducer.direct_launches
    hooked = _make_model("direct", _Net(), {})
    hooked.register_comm_hook(None, lockstep.comm_hooks.allreduce_hook)  # issues its collective up front
    _one_step(hooked, rank, 0)
    out["comm_hook_direct"] = hooked.reducer.direct_launches
    unknown = _make_model("direct", _Net(), {})

    def own_hook(state, bucket):  # not declared up front: it might use the buffer from a callback
        return lockstep.comm_hooks.allreduce_hook(state, bucket)

    unknown.register_comm_hook(None, own_hook)
    _one_step(unknown, rank, 0)
    out["unknown_hook_direct"] = unknown.reducer.direct_launches
    checked_hook = _make_model("direct", _Net(), {"detect_nonfinite": True})
    checked_hook.register_comm_hook(None, lockstep.comm_hooks.allreduce_hook)
    _one_step(checked_hook, rank, 0)
    out["checked_hook_direct"] = checked_hook.reducer.direct_launches
    # A user's post-accumulate-grad hook sees the local gradient, as with copies and in torch's DDP.
    seen = {}
    for impl in ("direct", "plain"):
        torch.manual_seed(0)
        m = _make_model(impl, _Net(), {})
        records = []
        m.module.fc2.weight.register_post_accumulate_grad_hook(lambda p, r=records: r.append(p.grad.clone()))
        _one_step(m, rank, 0)
        seen[impl] = (records[0], m.module.fc2.weight.grad.clone(), m.reducer.direct_launches)
    out["user_hook"] = {
        "same_local": torch.equal(seen["direct"][0], seen["plain"][0]),
        "same_average": torch.equal(seen["direct"][1], seen["plain"][1]),
        "local_is_not_average": not torch.equal(seen["direct"][0], seen["direct"][1]),
        "direct_launches": seen["direct"][2],
    }
    return out


def _powersgd(rank):
    """lockstep's PowerSGD (declared up front) with its buffer being .grad itself, against the same layout
    (one bucket per parameter) copied: every gradient of every step the same, compression on from step 1."""
    import lockstep
    from lockstep.comm_hooks import PowerSGDState, powersgd_hook

    out = {}
    for impl in ("direct", "plain"):
        def build(make, kw, impl=impl):
            model = _make_model(impl, make(), {**kw, "bucket_cap_mb_list": [0.0001]})
            model.register_comm_hook(PowerSGDState(None, 1, start_powerSGD_iter=1, random_seed=7), powersgd_hook)
            return model

        out[impl] = _train_with(build, rank, _Net, steps=6, set_to_none=True)
    probe = _make_model("direct", _Net(), {"bucket_cap_mb_list": [0.0001]})
    probe.register_comm_hook(PowerSGDState(None, 1, start_powerSGD_iter=1), powersgd_hook)
    _one_step(probe, rank, 0)
    out["direct_launches"] = probe.reducer.direct_launches
    assert lockstep.comm_hooks.issues_collectives_up_front(powersgd_hook)
    return out


def _all_cases(rank, world_size):
    return {"training": _training_cases(rank), "join": {impl: _join(rank, impl) for impl in IMPLS},
            "behaviour": _behaviour(rank), "powersgd": _powersgd(rank)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout_s=400)


@pytest.mark.parametrize("case", TRAINING)
def test_gradients_bit_identical_to_torch_every_step(results, case):
    for rank in range(2):
        runs = results[rank]["training"][case]
        for impl in ("direct", "plain"):
            for step, (ours, theirs) in enumerate(zip(runs[impl]["grads"], runs["torch"]["grads"])):
                assert _same(ours, theirs), f"{case} {impl} rank {rank} step {step}"
            assert all(torch.equal(runs[impl]["state"][k], v) for k, v in runs["torch"]["state"].items()), (case, impl)


def test_join_bit_identical_to_torch(results):
    for rank in range(2):
        runs = results[rank]["join"]
        for impl in ("direct", "plain"):
            assert _same(runs[impl]["after"], runs["torch"]["after"]), (rank, impl)
            assert all(torch.equal(a, b) for a, b in zip(runs[impl]["state"], runs["torch"]["state"])), (rank, impl)


def test_every_bucket_but_the_last_runs_direct(results):
    b = results[0]["behaviour"]
    # _Net's 6 parameters in reverse: fc3.bias .. fc1.weight, each direct at direct_min_bytes=1 but the
    # last, which carries the status flag (the bucket before it is direct, so it stays on its own).
    assert b["layout"] == [(True, 1)] * 5 + [(False, 1)]
    assert b["direct_launches"] == 5
    assert b["grads_outside_buckets"]  # .grad is autograd's tensor, not a bucket slot


def test_a_dropped_grad_is_freed_by_the_next_backward(results):
    for rank in range(2):
        assert results[rank]["behaviour"]["dropped_grad_freed"], rank


def test_direct_with_up_front_hooks_and_the_fused_nan_check_only(results):
    b = results[0]["behaviour"]
    assert b["nonfinite_direct"] == 5  # the check fused into the scaling (test_diagnostics_checks: its errors)
    assert b["nonfinite_after_direct"] == 0
    assert b["comm_hook_direct"] == 5  # the hook's buffer is .grad itself (parity: the hook_* training cases)
    assert b["unknown_hook_direct"] == 0
    assert b["checked_hook_direct"] == 0


def test_a_users_post_accumulate_hook_sees_the_local_gradient(results):
    for rank in range(2):
        u = results[rank]["behaviour"]["user_hook"]
        assert u["same_local"] and u["same_average"] and u["local_is_not_average"], (rank, u)
        assert u["direct_launches"] == 4  # the other four still went direct; fc2.weight was copied


def test_assign_buckets_direct_rules():
    from lockstep.ddp.buckets import assign_buckets

    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    params = list(mlp.parameters())  # w0 32 KiB, b0, w1 64 KiB, b1, w2 2 KiB, b2
    order = list(reversed(range(len(params))))
    plans = assign_buckets(params, order, 1 << 20, 1 << 20, direct_min_bytes=16 * 1024)
    # w1 and w0 go direct and leave the small bucket open: the biases and w2 share one bucket, last (it closes last).
    # Before, w1 closed it ([5, 4, 3]) and w0, which would have been last, joined b0's bucket, copied.
    assert [(p.param_indices, p.direct) for p in plans] == [([2], True), ([0], True), ([5, 4, 3, 1], False)]
    # Where the bucket before it had reached its cap (b0 alone fills 512 bytes), the last large parameter
    # stays a plain bucket of its own.
    plans = assign_buckets(params, order, 512, 512, direct_min_bytes=16 * 1024)
    assert [(p.param_indices, p.direct) for p in plans] == [([5, 4], False), ([3], False), ([2], True), ([1], False), ([0], False)]
    assert [(p.param_indices, p.direct) for p in assign_buckets(params, order, 1 << 20, 1 << 20)] == [([5, 4, 3, 2, 1, 0], False)]


def test_powersgd_on_the_gradient_itself_equals_copies(results):
    for rank in range(2):
        runs = results[rank]["powersgd"]
        assert runs["direct_launches"] == 5
        for step, (ours, theirs) in enumerate(zip(runs["direct"]["grads"], runs["plain"]["grads"])):
            assert _same(ours, theirs), (rank, step)
        assert all(torch.equal(runs["direct"]["state"][k], v) for k, v in runs["plain"]["state"].items())


def _three_ranks(rank, world_size):
    """3 ranks: direct buckets agree with torch's DDP to rounding (gloo's ring adds in an order that depends
    on an element's place in its buffer, and the buffers differ), the replicas stay identical, and the NaN
    check, which reads the averaged buckets at 3 ranks, keeps every gradient on copies."""
    runs = {}
    for impl in IMPLS:
        runs[impl] = _train_with(lambda make, kw, i=impl: _make_model(i, make(), kw), rank, _Net, steps=4)
    checked = _make_model("direct", _Net(), {"detect_nonfinite": True})
    _one_step(checked, rank, 0)
    return {"runs": runs, "checked_direct": checked.reducer.direct_launches,
            "params": [p.detach().clone() for p in checked.parameters()]}


def test_three_ranks_agree_to_rounding_and_the_nan_check_copies():
    results = run_ranks(_three_ranks, 3, timeout_s=240)
    for r in results:
        direct, torch_run = r["runs"]["direct"], r["runs"]["torch"]
        for step, (ours, theirs) in enumerate(zip(direct["grads"], torch_run["grads"])):
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, theirs)), step
        assert r["checked_direct"] == 0
    first = results[0]["runs"]["direct"]["state"]  # the replicas stay bit-identical to each other
    assert all(all(torch.equal(first[k], r["runs"]["direct"]["state"][k]) for k in first) for r in results[1:])
    assert all(all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"])) for r in results[1:])
