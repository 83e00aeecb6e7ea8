"""Where ZeRO-2 meets ``no_sync`` accumulation and global-norm clipping: bit for bit against torch's own DDP.

nanoGPT's recipe (issue #43): micro-batches under ``no_sync()``, then ``clip_grad_norm_(1.0)``, then AdamW. Here
lockstep's ``ddp.zero_optimizer(cls, stage=2)`` with ``opt.clip_grad_norm_`` runs against
``torch.nn.parallel.DistributedDataParallel`` with ``cls(ddp.parameters())`` and ``torch.nn.utils.clip_grad_norm_``,
the same seeds and data, 2 ranks on gloo. The matrix: every pair and the triple of the three features (ZeRO-2 +
clipping, ZeRO-2 + ``no_sync``, ZeRO-2 + both) x SGD with momentum and AdamW x foreach on and off x a bucket cap
that puts about one parameter in a bucket (each split between the two ranks' shards) and torch's 25 MB (one bucket,
one parameter split at its middle) x the collectives: the ring's halves over send/recv (gloo's default), the flat
pair and the all-reduce pair. Beside it, the triple with
what else meets the clip: gradients changed between backward and the clip (as a GradScaler's ``unscale_``), the
fp16 compress hook, ``find_unused_parameters``, ``zero_grad(set_to_none=False)``, the inf and 1 norms, the clip's
``foreach``. Asserted: the norm ``clip_grad_norm_`` returns at every step, and the parameters after the run, bit
for bit (max |difference| 0.0); and what the clip sends (``zero2_norm``): from its second step one all-reduce of a
value a parameter, the split parameters' pieces only where backward could not norm them. One 2-rank group runs
every case, one 3-rank group the triple (within rounding there, as without clipping: the figure is asserted);
``test_norms_of_slots_are_torchs`` checks the norm helpers in this process (on CUDA too where one is).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from dist_utils import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lockstep

STEPS = 30
MAX_NORM = 1.0
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
# (accumulate, clip): the triple, then each pair with ZeRO-2
FEATURES = {"no_sync+clip": (3, True), "clip": (1, True), "no_sync": (3, False)}
BUCKET_CAPS = {"small": 0.001, "large": 25.0}  # ~one parameter a bucket (250 floats); torch's default, one bucket
COLLECTIVES = ("ring", "flat", "all_reduce")  # LOCKSTEP_ZERO_COLLECTIVES (ring: gloo's default)
# The triple (AdamW, accumulate 3, small buckets) with one more thing meeting the clip
BESIDE: dict[str, dict] = {
    "grads_changed": {"scale_grads": 0.5},  # every step's split norms exchanged at the clip
    "grads_changed_flat": {"scale_grads": 0.5, "collectives": "flat"},
    "fp16_hook": {"hook": True},
    "fp16_hook_flat": {"hook": True, "collectives": "flat"},
    "fp16_hook_all_reduce": {"hook": True, "collectives": "all_reduce"},  # the ring adds in fp16 as gloo does
    "find_unused": {"unused": True},
    "find_unused_all_reduce": {"unused": True, "collectives": "all_reduce"},
    "set_to_none_false": {"set_to_none": False},
    "norm_inf": {"norm_type": math.inf},
    "norm_1": {"norm_type": 1.0},
    "clip_foreach_false": {"clip_foreach": False},
    "large_flat_sgd": {"opt_name": "sgd_momentum", "cap": 25.0, "collectives": "flat"},
}


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 33)
        self.fc2 = nn.Linear(33, 17)
        self.fc3 = nn.Linear(17, 5)  # odd-sized tensors: the shards split them mid-tensor
        self.idle = nn.Linear(5, 5) if unused else None  # no rank uses it: its .grad stays None, out of the norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _train(rank: int, impl: str, opt_name: str = "adamw", foreach: bool = False, accumulate: int = 3,
           clip: bool = True, cap: float = 0.001, collectives: str = "", hook: bool = False, unused: bool = False,
           set_to_none: bool = True, norm_type: float = 2.0, clip_foreach: bool | None = None,
           scale_grads: float | None = None, recorder=None) -> dict:
    cls, kwargs = OPTIMIZERS[opt_name]
    kwargs = dict(kwargs, foreach=foreach)
    torch.manual_seed(0)
    model = Net(unused)
    os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = collectives
    try:
        if impl == "torch":
            ddp: nn.Module = nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
        else:
            ddp = lockstep.DistributedDataParallel(model, bucket_cap_mb=cap, find_unused_parameters=unused)
        if hook:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = cls(ddp.parameters(), **kwargs) if impl == "torch" else ddp.zero_optimizer(cls, stage=2, **kwargs)
    finally:
        del os.environ["LOCKSTEP_ZERO_COLLECTIVES"]
    g = torch.Generator().manual_seed(100 + rank)
    norms, clip_calls, backward_calls = [], [], []
    scale = 2 * accumulate ** 0.5  # the targets' size: the averaged gradient's norm stays about MAX_NORM
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        if recorder is not None:
            recorder.calls, recorder.on = [], step == 1
        for micro in range(accumulate):
            x, y = torch.randn(8, 13, generator=g), scale * torch.randn(8, 5, generator=g)
            if micro < accumulate - 1:
                with ddp.no_sync():
                    ((ddp(x) - y).pow(2).mean() / accumulate).backward()
            else:
                ((ddp(x) - y).pow(2).mean() / accumulate).backward()
        if recorder is not None:
            backward_calls.append(recorder.calls)
            recorder.calls, recorder.on = [], True
        if scale_grads is not None:  # as GradScaler.unscale_ does, on every rank, between backward and the clip
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(scale_grads)
        if clip:
            if impl == "torch":
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM, norm_type, foreach=clip_foreach)
            else:
                norm = opt.clip_grad_norm_(MAX_NORM, norm_type, foreach=clip_foreach)
            norms.append(norm.detach().clone())
        if recorder is not None:
            recorder.on = False
            clip_calls.append(recorder.calls)
        opt.step()
    if impl != "torch":
        ddp.finish_step()  # the last step's all-gathers
    out = {"params": [p.detach().clone() for p in model.parameters()], "norms": norms}
    if impl != "torch":
        plan = ddp.reducer.strategy.norm_plan
        out.update(clip_calls=clip_calls, backward_calls=backward_calls[1] if backward_calls else [], split_numel=plan.split_numel,
                   n_params=len(plan.owners), buckets=len(plan.split), split_buckets=sum(map(bool, plan.split)))
    return out


def _diff(zero: dict, torch_run: dict) -> dict:
    """Max |difference| of the parameters and of the norms (0.0: bit for bit), and what the clip sent."""
    a, b = zero, torch_run
    out = {
        "params": max((x - y).abs().max().item() for x, y in zip(a["params"], b["params"])),
        "norms": max(((x - y).abs().item() for x, y in zip(a["norms"], b["norms"]) if x != y), default=0.0),
        "bits": all(torch.equal(x, y) for x, y in zip(a["params"] + a["norms"], b["params"] + b["norms"])),
        "clipped": sum(float(n) > MAX_NORM for n in b["norms"]),
    }
    out.update({k: zero[k] for k in ("clip_calls", "backward_calls", "split_numel", "n_params", "buckets",
                                     "split_buckets")})
    return out


def _cases(rank: int, world_size: int) -> dict:
    from test_schedule import Recorder

    recorder = Recorder()  # wraps torch.distributed's functions in this rank; records only while on
    out: dict = {}
    for opt_name in OPTIMIZERS:
        for foreach in (False, True):
            for feature, (accumulate, clip) in FEATURES.items():
                if accumulate > 1 and foreach:
                    accumulate = 2  # 2 and 3 micro-batches both run
                torch_run = _train(rank, "torch", opt_name, foreach, accumulate, clip)
                for cap_name, cap in BUCKET_CAPS.items():
                    for collectives in COLLECTIVES:
                        zero = _train(rank, "zero2", opt_name, foreach, accumulate, clip, cap, collectives,
                                      recorder=recorder)
                        out[(feature, opt_name, foreach, cap_name, collectives)] = _diff(zero, torch_run)
    for name, kwargs in BESIDE.items():
        torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("cap", "collectives")}
        out[name] = _diff(_train(rank, "zero2", recorder=recorder, **kwargs), _train(rank, "torch", **torch_kwargs))
    return out


def _three(rank: int, world_size: int) -> dict:
    torch_run = _train(rank, "torch")
    return {coll: _diff(_train(rank, "zero2", collectives=coll), torch_run) for coll in ("ring", "flat", "all_reduce")}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, world_size=2, timeout_s=900)


@pytest.fixture(scope="module")
def results3():
    return run_ranks(_three, world_size=3, timeout_s=600)


MATRIX = [(feature, opt_name, foreach, cap, coll) for feature in FEATURES for opt_name in OPTIMIZERS
          for foreach in (False, True) for cap in BUCKET_CAPS for coll in COLLECTIVES]


@pytest.mark.parametrize("case", MATRIX + list(BESIDE), ids=["-".join(map(str, c)) if isinstance(c, tuple) else c
                                                            for c in MATRIX + list(BESIDE)])
def test_bit_for_bit_with_torchs_ddp(results, case):
    for rank in (0, 1):
        got = results[rank][case]
        assert got["bits"], f"rank {rank}: {case}: parameters {got['params']}, norms {got['norms']}"
        assert got["params"] == 0.0 and got["norms"] == 0.0


def test_the_cases_clip_and_split_parameters(results):
    # the coefficient matters: a regression to targets 2 x N(0, 1) (x the root of the micro-batch count) keeps the
    # norm about MAX_NORM, so some steps clip (the coefficient's last bit reaches the update) and some do not; and
    # both bucket caps leave a parameter split between the shards (its norm needs both ranks' pieces)
    for case, got in results[0].items():
        if case in MATRIX and case[0] != "no_sync":
            assert 1 <= got["clipped"] < STEPS, case
        assert got["split_numel"] > 0 and got["split_buckets"] >= 1, case


def _sent(calls: list) -> list:
    return [(kind, numel) for kind, numel, _ in calls]


@pytest.mark.parametrize("case", [c for c in MATRIX if c[0] != "no_sync"] + ["fp16_hook_flat", "large_flat_sgd"])
def test_a_clip_is_one_all_reduce_of_a_value_a_parameter(results, case):
    # the first clip exchanges the split parameters' pieces (one all-reduce a bucket holding one); from then on
    # backward norms them from the bucket's whole average and the clip sends the n_params norms only
    for rank in (0, 1):
        got = results[rank][case]
        n = got["n_params"]
        assert all(_sent(calls) == [("all_reduce", n)] for calls in got["clip_calls"][1:]), got["clip_calls"][1]
        first = _sent(got["clip_calls"][0])
        assert first[0] == ("all_reduce", n) and len(first) == 1 + got["split_buckets"]


@pytest.mark.parametrize("case", ["grads_changed", "grads_changed_flat"])
def test_gradients_changed_after_backward_are_exchanged_at_the_clip(results, case):
    # a backward's split norms are of the gradient it left: changed since (GradScaler.unscale_), the clip sends the
    # pieces again, every step, and stays exact (test_bit_for_bit_with_torchs_ddp)
    got = results[0][case]
    assert all(len(calls) == 1 + got["split_buckets"] for calls in got["clip_calls"])


def test_with_clipping_the_flat_path_all_reduces_the_buckets_that_split_a_parameter(results):
    # the flat reduce-scatter (and the ring's) leaves no whole average to norm a split parameter from: such a bucket
    # is reduced as gloo's default does (all-reduce, slice kept); the others still reduce-scatter. The recorded step
    # is the second, after the first clip
    for case in ("large_flat_sgd", ("clip", "adamw", False, "small", "flat"), ("clip", "adamw", False, "small", "ring")):
        got = results[0][case]
        kinds = [kind for kind, _, _ in got["backward_calls"]]
        scatter = "ring_reduce_scatter" if "ring" in case else "reduce_scatter_tensor"
        assert kinds.count(scatter) == got["buckets"] - got["split_buckets"], kinds
        assert kinds.count("all_reduce") == got["split_buckets"] + 1, kinds  # + the status flag's
    for coll, scatter in (("flat", "reduce_scatter_tensor"), ("ring", "ring_reduce_scatter")):
        nothing_clipped = results[0][("no_sync", "adamw", False, "small", coll)]
        kinds = [kind for kind, _, _ in nothing_clipped["backward_calls"]]
        assert kinds.count(scatter) == nothing_clipped["buckets"]


def test_at_3_ranks_within_rounding(results3):
    # three values add in the ring's order, which the padded buckets' chunks move (as without clipping): 7.5e-8 in
    # the parameters and 6e-8 in the norms after 30 steps of the triple here; the clip adds no difference of its own
    for coll in ("ring", "flat", "all_reduce"):
        assert results3[0][coll]["params"] < 1e-6 and results3[0][coll]["norms"] < 1e-6
        assert all(r[coll]["params"] == results3[0][coll]["params"] for r in results3)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_norms_of_slots_are_torchs(device):
    # a slot of a flat buffer at any offset normed as torch norms a .grad of its own; the total over mixed dtypes
    # stacked in torch's grouping order
    from lockstep.ddp.zero2_norm import as_torchs_grad, param_norms, total_norm

    g = torch.Generator().manual_seed(0)
    buffer = torch.empty(5000, device=device)
    for numel in (1, 3, 4, 17, 64, 255, 1024, 3001):
        grad = torch.randn(numel, generator=g).to(device)
        for offset in range(0, 9):
            slot = buffer[offset:offset + numel]
            slot.copy_(grad)
            for norm_type in (2.0, 1.0, math.inf):
                ours = param_norms([as_torchs_grad(slot)], norm_type, None)[0]
                assert torch.equal(ours, torch._foreach_norm([grad.clone()], norm_type)[0]), (numel, offset)
    grads = [torch.randn(n, generator=g).to(device, dtype) for n, dtype in
             ((33, torch.float32), (7, torch.float64), (100, torch.bfloat16), (5, torch.float32), (9, torch.float64))]
    for norm_type in (2.0, math.inf):
        norms = [param_norms([t], norm_type, None)[0] for t in grads]
        expected = torch.nn.utils.get_total_norm(grads, norm_type)
        assert torch.equal(total_norm(norms, norm_type), expected)
