"""ZeRO-2 inside lockstep's DDP: ``opt = ddp.zero_optimizer(optimizer_class, stage=2, **defaults)``.

At 2 gloo ranks the parameters after 50 steps equal, bit for bit, lockstep's plain DDP with the same optimizer (SGD
with momentum, Adam, AdamW; foreach on and off), with and without ``no_sync`` accumulation, through the flat
collectives, through gloo's default, the ring's halves over send/recv, and through the all-reduce pair (slice kept,
-0.0 elsewhere: ``LOCKSTEP_ZERO_COLLECTIVES=all_reduce``); also with torch's LR schedulers over the
returned optimizer, ``zero_grad(set_to_none=False)``, ``static_graph``, ``find_unused_parameters`` (a layer no rank
uses), the fp16 compress hook and ``join`` with uneven inputs. It really shards: each rank's optimizer state is its
half, ``.grad`` is None after backward and the buckets' memory is freed. Its collectives are reduce-scatters in
bucket order, the status all-reduce, then all-gathers in bucket order from ``opt.step()``, waited for in the next
forward. ``clip_grad_norm_`` takes the global norm with torch's bits; a NaN raises on both ranks before the update; the
sharded state dict resumes bit for bit and the consolidated one is a plain torch optimizer's (equal to plain DDP's own
state dict). The ring pair also with buckets shorter than the world size and not divisible by it, sending (N-1)/N
of each bucket in each half (counted), and a peer that leaves mid-step ending in an error naming the ring op and
the bucket. One spawned 2-rank group and one 3-rank group (within rounding there: the figure is asserted), and a
2-rank group whose rank 1 leaves.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

import lockstep
from lockstep.ddp.observe import StepObserver

STEPS = 50
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 33)
        self.fc2 = nn.Linear(33, 17)
        self.fc3 = nn.Linear(17, 5)  # 1,192 parameters in odd-sized tensors: shards split them mid-tensor
        self.unused = nn.Linear(5, 5)  # used only where asked

    def forward(self, x: torch.Tensor, use_all: bool = True) -> torch.Tensor:
        h = self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
        return self.unused(h) if use_all else h


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _train(rank: int, zero: bool, opt_name: str = "adamw", *, foreach: bool | None = None, accumulate: int = 1,
           steps: int = STEPS, ddp_kwargs: dict | None = None, use_all: bool = True, schedule: str = "",
           set_to_none: bool = True, hook: Any = None, clip: float | None = None) -> dict:
    cls, kwargs = OPTIMIZERS[opt_name]
    kwargs = dict(kwargs, foreach=foreach)
    ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001, **(ddp_kwargs or {}))  # several buckets
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = ddp.zero_optimizer(cls, stage=2, **kwargs) if zero else cls(ddp.parameters(), **kwargs)
    scheduler = None
    if schedule == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    elif schedule == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    norms = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(accumulate):
            x = torch.randn(8, 13, generator=g)
            if micro < accumulate - 1:
                with ddp.no_sync():
                    ddp(x, use_all).pow(2).mean().backward()
            else:
                ddp(x, use_all).pow(2).mean().backward()
        if clip is not None:
            norm = opt.clip_grad_norm_(clip) if zero else torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            norms.append(float(norm))
        opt.step()
        if scheduler is not None:
            scheduler.step()
    ddp.finish_step()
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "norms": norms, "ddp": ddp, "opt": opt}


def _diff(a: dict, b: dict) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a["params"], b["params"]))


def _exactness(rank: int) -> dict:
    out = {}
    for opt_name in OPTIMIZERS:
        for foreach in (False, True):
            for accumulate in (1, 3):
                plain = _train(rank, False, opt_name, foreach=foreach, accumulate=accumulate)
                zero = _train(rank, True, opt_name, foreach=foreach, accumulate=accumulate)
                out[(opt_name, foreach, accumulate)] = _diff(plain, zero)
    return out


def _semantics(rank: int) -> dict:
    """Each DDP option and loop habit, ZeRO-2 against plain DDP (max |difference| after the run; 0.0 = bit for bit)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cases: dict[str, dict] = {
        "lambda_lr": {"schedule": "lambda", "steps": 12},
        "step_lr": {"schedule": "step", "steps": 12},
        "set_to_none_false": {"set_to_none": False, "steps": 12, "opt_name": "sgd_momentum"},
        "static_graph": {"ddp_kwargs": {"static_graph": True}, "steps": 12},
        # A layer no rank uses: plain DDP leaves its .grad None and the optimizer skips it; ZeRO-2's shard
        # elements get a zero gradient (SGD and Adam then leave them as they are)
        "find_unused_sgd": {"ddp_kwargs": {"find_unused_parameters": True}, "use_all": False, "steps": 12,
                            "opt_name": "sgd_momentum"},
        "find_unused_adam": {"ddp_kwargs": {"find_unused_parameters": True}, "use_all": False, "steps": 12,
                             "opt_name": "adam"},
        "fp16_hook": {"hook": default_hooks.fp16_compress_hook, "steps": 12},
        "fp16_hook_lockstep": {"hook": lockstep.comm_hooks.fp16_compress_hook, "steps": 12},
    }
    out = {}
    for name, kwargs in cases.items():
        out[name] = _diff(_train(rank, False, **kwargs), _train(rank, True, **kwargs))
    plain, zero = _train(rank, False, clip=0.05, steps=12), _train(rank, True, clip=0.05, steps=12)
    out["clip_params"] = _diff(plain, zero)
    out["clip_norms"] = max(abs(a - b) / a for a, b in zip(plain["norms"], zero["norms"]))
    os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = "flat"  # gloo's reduce_scatter_tensor / all_gather_into_tensor
    try:
        flat = _train(rank, True, steps=20)
    finally:
        del os.environ["LOCKSTEP_ZERO_COLLECTIVES"]
    out["flat"] = _diff(_train(rank, False, steps=20), flat)
    out["flat_collectives"] = flat["opt"].collectives
    with _collectives_env("all_reduce"):  # gloo's all-reduce pair, with find_unused_parameters too
        pair = _train(rank, True, steps=20)
        pair_unused = _train(rank, True, **cases["find_unused_adam"])
    out["all_reduce"] = _diff(_train(rank, False, steps=20), pair)
    out["all_reduce_collectives"] = pair["opt"].collectives
    out["find_unused_all_reduce"] = _diff(_train(rank, False, **cases["find_unused_adam"]), pair_unused)
    out["default_collectives"] = _train(rank, True, steps=1)["opt"].collectives
    return out


class _collectives_env:
    """``LOCKSTEP_ZERO_COLLECTIVES`` set while binding (read there), and unset after."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __enter__(self) -> None:
        os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = self.value

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("LOCKSTEP_ZERO_COLLECTIVES", None)


def _sharding(rank: int) -> dict:
    """What a rank holds: its half of the optimizer state, no .grad, freed buckets; the update lands per bucket."""
    ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001)
    opt = ddp.zero_optimizer(torch.optim.Adam, lr=1e-2)
    x = torch.randn(8, 13, generator=torch.Generator().manual_seed(rank))
    ddp(x).pow(2).mean().backward()
    seen: dict[str, Any] = {
        "grads_none": all(p.grad is None for p in ddp.parameters()),
        "buckets_freed": all(b.buffer.untyped_storage().size() == 0 for b in ddp.reducer.buckets),
        "shard_grads": sum(p.grad.numel() for g in opt.param_groups for p in g["params"] if p.grad is not None),
    }
    opt.step()
    seen["state_numel"] = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    seen["model_numel"] = sum(p.numel() for p in ddp.parameters())
    seen["gathers_in_flight"] = ddp.reducer.strategy.in_flight()
    ddp(x)
    seen["gathers_after_forward"] = ddp.reducer.strategy.in_flight()
    return seen


class _Kinds(StepObserver):
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def collective(self, kind: str) -> None:  # the next forward's all-gathers
        self.kinds.append(kind)

    def waiting(self, buckets, op: str) -> None:  # the end of backward's reduce-scatters
        self.kinds.append(op)


def _collectives(rank: int) -> dict:
    return {"all_reduce": _collectives_of(rank, "all_reduce"), "flat": _collectives_of(rank, "flat"),
            "ring": _collectives_of(rank, "")}


def _collectives_of(rank: int, env: str) -> dict:
    """The kind, size and order of one step's collectives (recorded around torch.distributed's functions)."""
    from test_schedule import Recorder

    os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = env
    recorder = Recorder()
    ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001, forward_sync_buffers=False)
    opt = ddp.zero_optimizer(torch.optim.SGD, lr=0.1)
    kinds = _Kinds()
    ddp.reducer.attach_observer(kinds)
    x = torch.randn(8, 13, generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        recorder.on = step == 1
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
    recorder.on = False
    ddp.finish_step()
    del os.environ["LOCKSTEP_ZERO_COLLECTIVES"]
    shards = [s.numel() for s in ddp.reducer.strategy.shards]
    return {"calls": recorder.calls, "shards": shards, "kinds": kinds.kinds}


def _nonfinite(rank: int) -> dict:
    ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001, detect_nonfinite=True)
    opt = ddp.zero_optimizer(torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(8, 13, generator=g)
        if step == 3 and rank == 1:
            x[0, 0] = float("nan")
        ddp.finish_step()  # the last step's all-gathers: read the parameters only after them
        before = [p.detach().clone() for p in ddp.parameters()]
        try:
            ddp(x).pow(2).mean().backward()
        except lockstep.NonfiniteGradientError as error:
            opt.step()  # the shards let go of what raised: a step after the error moves nothing
            ddp.finish_step()
            kept = all(torch.equal(a, p) for a, p in zip(before, ddp.parameters()))
            return {"step": step, "error": str(error)[:600], "kept": kept}
        opt.step()
    return {"step": None}


def _checkpoints(rank: int) -> dict:
    """Sharded state dict: resume bit for bit. Consolidated: a plain torch optimizer's, equal to plain DDP's."""
    out: dict[str, Any] = {}
    straight = _train(rank, True, "adam", steps=20)
    first = _train(rank, True, "adam", steps=10)
    # deep copies, as a file would be: torch's load_state_dict shares Adam's step tensors, which resumed steps add to
    saved_model = copy.deepcopy(first["ddp"].module.state_dict())
    saved_opt = copy.deepcopy(first["opt"].state_dict())
    consolidated = first["opt"].consolidate_state_dict(to=0)
    out["consolidated_on_rank_1_is_none"] = consolidated is None if rank == 1 else None
    plain = _train(rank, False, "adam", steps=10)
    if rank == 0:
        reference = plain["opt"].state_dict()
        out["same_keys"] = consolidated.keys() == reference.keys() and sorted(consolidated["state"]) == sorted(
            reference["state"])
        out["state_diff"] = max((consolidated["state"][i][k] - v).abs().max().item()
                                for i, s in reference["state"].items() for k, v in s.items())
        fresh = torch.optim.Adam(_net().parameters(), lr=1e-2)
        fresh.load_state_dict(consolidated)  # loads into a plain torch optimizer
        out["plain_loads"] = True
    # Resume from the sharded state: 10 more steps from step 10 equal 20 straight.
    ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001)
    ddp.module.load_state_dict(saved_model)
    opt = ddp.zero_optimizer(torch.optim.Adam, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(saved_opt))
    # the same data as the straight run's steps 10-19
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(10):
        torch.randn(8, 13, generator=g)
    for _ in range(10):
        opt.zero_grad()
        ddp(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
        opt.step()
    ddp.finish_step()
    out["resumed_diff"] = max((a - p.detach()).abs().max().item()
                              for a, p in zip(straight["params"], ddp.module.parameters()))
    # And from the consolidated one (every rank loads the whole dict: broadcast here as a file would be read).
    holder = [consolidated]
    torch.distributed.broadcast_object_list(holder, src=0)
    ddp2 = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001)
    ddp2.module.load_state_dict(saved_model)
    opt2 = ddp2.zero_optimizer(torch.optim.Adam, lr=1e-2)
    opt2.load_state_dict(holder[0])
    mine, theirs = opt2.state_dict()["optimizer"]["state"], saved_opt["optimizer"]["state"]
    out["full_load_state_diff"] = max((mine[i][k] - v).abs().max().item() for i, s in theirs.items()
                                      for k, v in s.items())
    out["full_load_keys"] = sorted(mine) == sorted(theirs) and all(mine[i].keys() == s.keys()
                                                                    for i, s in theirs.items())
    return out


def _join(rank: int) -> dict:
    """Uneven inputs under join: rank 0 has 5 batches, rank 1 has 3; ZeRO-2 against plain DDP."""
    results = {}
    for zero in (False, True):
        ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001)
        opt = ddp.zero_optimizer(torch.optim.SGD, lr=0.1) if zero else torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        with ddp.join():
            for _ in range(5 if rank == 0 else 3):
                opt.zero_grad()
                ddp(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
                opt.step()
        ddp.finish_step()
        results[zero] = [p.detach().clone() for p in ddp.parameters()]
    return {"diff": max((a - b).abs().max().item() for a, b in zip(results[False], results[True]))}


def _errors(rank: int) -> dict:
    out = {}

    def attempt(name: str, make) -> None:
        try:
            make()
        except (ValueError, TypeError, RuntimeError) as error:
            out[name] = str(error)
        else:
            out[name] = "no error"

    def ddp(**kw):
        return lockstep.DistributedDataParallel(_net(), **kw)

    attempt("stage1", lambda: ddp().zero_optimizer(torch.optim.SGD, stage=1, lr=0.1))
    attempt("stage3", lambda: ddp().zero_optimizer(torch.optim.SGD, stage=3, lr=0.1))
    attempt("stage4", lambda: ddp().zero_optimizer(torch.optim.SGD, stage=4, lr=0.1))
    attempt("params", lambda: ddp().zero_optimizer(torch.optim.SGD, params=[nn.Parameter(torch.ones(1))], lr=0.1))
    attempt("bucket_view", lambda: ddp(gradient_as_bucket_view=True).zero_optimizer(torch.optim.SGD, lr=0.1))
    attempt("lbfgs", lambda: ddp().zero_optimizer(torch.optim.LBFGS, lr=0.1))
    attempt("instance", lambda: ddp().zero_optimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)))

    def hook_first():
        model = ddp()
        model.register_comm_hook(None, lockstep.comm_hooks.allreduce_hook)
        model.zero_optimizer(torch.optim.SGD, lr=0.1)

    def hook_after():
        model = ddp()
        model.zero_optimizer(torch.optim.SGD, lr=0.1)
        model.register_comm_hook(None, lockstep.comm_hooks.allreduce_hook)

    attempt("hook_first", hook_first)
    attempt("hook_after", hook_after)

    def twice():
        model = ddp()
        model.zero_optimizer(torch.optim.SGD, lr=0.1)
        model.zero_optimizer(torch.optim.SGD, lr=0.1)

    attempt("twice", twice)

    def moved_after_binding():  # every rank casts, so every rank raises at the same point, before any all-gather
        model = ddp()
        opt = model.zero_optimizer(torch.optim.SGD, lr=0.1)
        model(torch.randn(8, 13)).pow(2).mean().backward()
        model.module.double()  # the parameters get new storage: the step would no longer reach them
        opt.step()

    attempt("moved", moved_after_binding)
    attempt("add_param_group", lambda: ddp().zero_optimizer(torch.optim.SGD, lr=0.1).add_param_group(
        {"params": [nn.Parameter(torch.ones(1))]}))
    return out


class _Tiny(nn.Module):
    """Buckets of one parameter each (``bucket_cap_mb=1e-6``): 1 element (shorter than the world size) and 5, 7,
    35, 91 (divisible by neither 2 nor 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.fc1 = nn.Linear(13, 7)
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def _train_tiny(rank: int, collectives: str | None, steps: int = 10) -> tuple[Any, list[torch.Tensor]]:
    """AdamW on ``_Tiny``: ZeRO-2 through ``collectives`` (None: plain DDP); the DDP and the parameters after."""
    torch.manual_seed(0)
    ddp = lockstep.DistributedDataParallel(_Tiny(), bucket_cap_mb=1e-6)
    with _collectives_env(collectives or ""):
        opt = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if collectives is None
               else ddp.zero_optimizer(torch.optim.AdamW, lr=1e-2))
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
        opt.step()
    ddp.finish_step()
    return ddp, [p.detach().clone() for p in ddp.module.parameters()]


def _ring_shapes(rank: int, world_size: int) -> dict:
    """The ring pair on buckets shorter than the world size and not divisible by it, against plain DDP and the
    all-reduce pair; and the bytes the ring sent in 10 steps against (N-1)/N of each padded bucket in each half."""
    plain = _train_tiny(rank, None)[1]
    ddp, ring = _train_tiny(rank, "ring")
    pair = _train_tiny(rank, "all_reduce")[1]
    plans = [b.plan for b in ddp.reducer.buckets]
    padded_nbytes = sum(p.padded_numel * 4 for p in plans)
    return {
        "vs_plain": max((a - b).abs().max().item() for a, b in zip(ring, plain)),
        "vs_pair": max((a - b).abs().max().item() for a, b in zip(ring, pair)),
        "numels": [p.numel for p in plans],
        "sent": ddp.reducer.strategy.wire.sent_nbytes,
        "expected_sent": 10 * 2 * (world_size - 1) * padded_nbytes // world_size,
    }


def _peer_leaves(rank: int, world_size: int) -> dict:
    """Two ring steps on both ranks; then rank 1 leaves after its backward (its process ends) and rank 0's step's
    all-gathers must fail, named, within the group timeout (5 s here), not hang."""
    import time

    with _collectives_env("ring"):
        ddp = lockstep.DistributedDataParallel(_net(), bucket_cap_mb=0.001)
        opt = ddp.zero_optimizer(torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 13, generator=g)).pow(2).mean().backward()
        if step == 2 and rank == 1:
            return {}
        opt.step()
    start = time.monotonic()
    try:
        ddp.finish_step()
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    return {"message": message, "elapsed_s": time.monotonic() - start, "buckets": len(ddp.reducer.buckets)}


def _case2(rank: int, world_size: int) -> dict:
    return {"exactness": _exactness(rank), "semantics": _semantics(rank), "sharding": _sharding(rank),
            "collectives": _collectives(rank), "nonfinite": _nonfinite(rank), "checkpoints": _checkpoints(rank),
            "join": _join(rank), "errors": _errors(rank), "ring_shapes": _ring_shapes(rank, world_size)}


def _case3(rank: int, world_size: int) -> dict:
    out = {}
    for opt_name in OPTIMIZERS:
        for accumulate in (1, 3):
            plain = _train(rank, False, opt_name, accumulate=accumulate)
            zero = _train(rank, True, opt_name, accumulate=accumulate)
            out[(opt_name, accumulate)] = _diff(plain, zero)
            with _collectives_env("all_reduce"):
                pair = _train(rank, True, opt_name, accumulate=accumulate)
            out[(opt_name, accumulate, "all_reduce")] = _diff(plain, pair)
    out["ring_shapes"] = _ring_shapes(rank, world_size)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_case2, world_size=2, timeout_s=600)


@pytest.fixture(scope="module")
def results3():
    return run_ranks(_case3, world_size=3, timeout_s=600)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_bit_identical_to_plain_ddp_at_2_ranks(results, opt_name, foreach, accumulate):
    for rank in (0, 1):
        assert results[rank]["exactness"][(opt_name, foreach, accumulate)] == 0.0


@pytest.mark.parametrize("case", ["lambda_lr", "step_lr", "set_to_none_false", "static_graph", "find_unused_sgd",
                                  "find_unused_adam", "fp16_hook", "fp16_hook_lockstep", "flat", "all_reduce",
                                  "find_unused_all_reduce"])
def test_ddp_semantics_bit_for_bit(results, case):
    assert results[0]["semantics"][case] == 0.0
    assert results[1]["semantics"][case] == 0.0


def test_clip_grad_norm_is_the_global_norm(results):
    # torch's clip_grad_norm_'s own bits (each parameter's norm over its whole gradient, then the norm of those:
    # ddp/zero2_norm.py), and the parameters after 12 clipped steps; test_zero2_exact.py holds every pair of
    # ZeRO-2, no_sync and clipping to torch's DDP
    for rank in (0, 1):
        assert results[rank]["semantics"]["clip_norms"] == 0.0
        assert results[rank]["semantics"]["clip_params"] == 0.0


def test_the_optimizer_says_which_collectives_ran(results):
    sem = results[0]["semantics"]
    assert sem["flat_collectives"] == ("reduce_scatter_tensor", "all_gather_into_tensor")
    assert sem["all_reduce_collectives"] == ("all_reduce, slice kept", "all_reduce, -0.0 elsewhere")
    # gloo's default: the ring's halves (zero2_wire.choose_collectives: a DDP step's bytes, not slower than the
    # all-reduce pair on loopback, which is cheaper than gloo's flat pair)
    assert sem["default_collectives"] == ("ring reduce-scatter (send/recv)", "ring all-gather (send/recv)")


def test_each_rank_holds_its_shard(results):
    for rank in (0, 1):
        s = results[rank]["sharding"]
        assert s["grads_none"] and s["buckets_freed"]
        # padded to even shards: at most one element more per bucket
        assert s["model_numel"] / 2 <= s["shard_grads"] <= s["model_numel"] / 2 + 20
        assert s["state_numel"] == 2 * s["shard_grads"]  # Adam: exp_avg and exp_avg_sq of the shard only
        assert s["gathers_in_flight"] and not s["gathers_after_forward"]


@pytest.mark.parametrize("kind", ["all_reduce", "flat", "ring"])
def test_collectives_kind_and_order(results, kind):
    for rank in (0, 1):
        c = results[rank]["collectives"][kind]
        n = len(c["shards"])
        assert n >= 2
        padded = [2 * s for s in c["shards"]]
        # the reduce-scatters in bucket order (flat: into each shard; else an all-reduce of each padded bucket),
        # the status flag's all-reduce, then the all-gathers (of each whole padded bucket), from the last bucket (the
        # first layers, which the next forward needs first) back
        if kind == "flat":
            expected = ([("reduce_scatter_tensor", s) for s in c["shards"]] + [("all_reduce", 1)]
                        + [("all_gather_into_tensor", p) for p in reversed(padded)])
        elif kind == "ring":  # launched on the ring's queue (recorded there), the flag on the DDP's group
            expected = ([("ring_reduce_scatter", p) for p in padded] + [("all_reduce", 1)]
                        + [("ring_all_gather", p) for p in reversed(padded)])
        else:
            expected = ([("all_reduce", p) for p in padded] + [("all_reduce", 1)]
                        + [("all_reduce", p) for p in reversed(padded)])
        assert [call[:2] for call in c["calls"]] == expected, c["calls"]
        assert results[0]["collectives"][kind]["calls"] == results[1]["collectives"][kind]["calls"]
        # what the hang report would name: the end of backward's waits, then the step's and the forward's
        assert c["kinds"][:2] == ["reduce-scatter", "all-gather"]
        assert set(c["kinds"]) == {"reduce-scatter", "all-gather"}


def test_nonfinite_raises_on_both_ranks_before_the_update(results):
    for rank in (0, 1):
        r = results[rank]["nonfinite"]
        assert r["step"] == 3 and "non-finite gradient on rank 1" in r["error"] and r["kept"], r
        assert "'fc1.weight' (429 NaN" in r["error"], r  # named from rank 1's local gradients


def test_checkpoints(results):
    r0, r1 = results[0]["checkpoints"], results[1]["checkpoints"]
    assert r1["consolidated_on_rank_1_is_none"]
    assert r0["same_keys"] and r0["state_diff"] == 0.0 and r0["plain_loads"]
    assert r0["resumed_diff"] == 0.0 and r1["resumed_diff"] == 0.0
    assert r0["full_load_state_diff"] == 0.0 and r1["full_load_state_diff"] == 0.0
    assert r0["full_load_keys"] and r1["full_load_keys"]


def test_join_with_uneven_inputs(results):
    assert results[0]["join"]["diff"] == 0.0 and results[1]["join"]["diff"] == 0.0


def test_refusals_are_one_line_and_name_the_argument(results):
    e = results[0]["errors"]
    assert "lockstep.ZeroRedundancyOptimizer" in e["stage1"]
    # stage 3 is FSDP, named with where it lives (it said only "stage must be 2, got 3")
    assert e["stage3"] == ("zero_optimizer: stage=3 (sharded parameters) is FSDP, which lockstep does not do: wrap "
                           "the model in torch.distributed.fsdp (fully_shard) instead of lockstep's DDP (docs/zero.md); "
                           "this method is stage=2"), e["stage3"]
    assert e["stage4"] == "zero_optimizer: stage must be 2 (ZeRO-2; 1 is lockstep.ZeroRedundancyOptimizer, 3 is " \
                          "FSDP: torch.distributed.fsdp), got 4", e["stage4"]
    # ZeRO-1's params= given here reached SGD itself: "SGD.__init__() got multiple values for argument 'params'"
    assert e["params"].startswith("zero_optimizer: params= is not an argument"), e["params"]
    assert "lockstep.ZeroRedundancyOptimizer(params=..., optimizer_class=...)" in e["params"], e["params"]
    assert "gradient_as_bucket_view=False" in e["bucket_view"]
    assert "LBFGS" in e["lbfgs"]
    assert "optimizer_class" in e["instance"]
    assert "allreduce_hook" in e["hook_first"] and "allreduce_hook" in e["hook_after"]
    assert "a strategy is bound already (ZeRO-2; " in e["twice"]
    assert "add_param_group" in e["add_param_group"]
    # the first parameter of the first bucket (the reverse of the model's order)
    assert e["moved"].startswith("zero_optimizer: parameter 'unused.bias' no longer lives in its ZeRO-2 bucket"), e
    assert all("\n" not in message for message in e.values())


# Beyond 2 ranks gloo's reduce-scatter adds in another order than its all-reduce: within rounding. Measured on
# this model after 50 steps at 3 ranks (2026-11-26): at most 6.0e-08 (parameters of order 0.1-1).
ROUNDING_3_RANKS = 1e-6


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("collectives", ["ring", "all_reduce"])
def test_within_rounding_at_3_ranks(results3, opt_name, accumulate, collectives):
    key = (opt_name, accumulate) if collectives == "ring" else (opt_name, accumulate, "all_reduce")  # ring: default
    for rank in range(3):
        assert results3[rank][key] <= ROUNDING_3_RANKS


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_on_short_and_uneven_buckets_sends_a_ddp_steps_bytes(results, results3, world_size):
    for rank in range(world_size):
        got = (results if world_size == 2 else results3)[rank]["ring_shapes"]
        assert min(got["numels"]) < world_size and any(n % world_size for n in got["numels"]), got
        if world_size == 2:  # one addition of two values: the bits of plain DDP and of the all-reduce pair
            assert got["vs_plain"] == 0.0 and got["vs_pair"] == 0.0, got
        else:
            assert got["vs_plain"] <= ROUNDING_3_RANKS and got["vs_pair"] <= ROUNDING_3_RANKS, got
        # (N-1)/N of each padded bucket in each half: what a ring all-reduce of the buckets sends
        assert got["sent"] == got["expected_sent"], got


def test_a_peer_that_leaves_is_a_named_error_not_a_hang():
    got = run_ranks(_peer_leaves, world_size=2, timeout_s=120, pg_timeout_s=5)[0]
    message = got["message"]
    # the first bucket waited for is bucket 0, launched last: not run, after the first launched (the last) failed
    assert message.startswith("lockstep ring all-gather of bucket 0 ("), message
    assert f"ring all-gather of bucket {got['buckets'] - 1} (" in message and "failed on global rank 0" in message
    assert got["elapsed_s"] < 15, got
