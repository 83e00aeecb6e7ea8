"""DiLoCo (``lockstep.DiLoCo``, ``ddp/diloco.py``) on real gloo ranks: the arithmetic, the replicas, the wire, resume.

One 2-rank group runs every case (``_cases``) and the tests assert on what each rank returned: the H = 1 check
against torch's DDP (outer SGD lr 1.0, no momentum, inner SGD: DDP's parameters within rounding), every replica
equal bit for bit after each sync (fp32, bf16 and fp16 on the wire, and streaming with 2 fragments, where each
fragment is equal once it lands and the synced copies always are), the bytes each sync sends, bad arguments refused
in one line, a checkpoint that resumes bit for bit (a fragment in flight at the save included), a hang reported as
"the outer all-reduce". A 1-rank group then resumes the 2-rank run's state (another world size).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

from lockstep import DiLoCo, DiLoCoConfig, OuterSyncError
from lockstep.ddp.diloco import assign_buckets, assign_fragments

# H = 1 against torch's DDP: the pseudo-gradient is anchor - (anchor - lr * g), a difference of two rounded
# parameters, not lr * g itself: up to half an ulp of the parameter (|p| ~ 0.3: ~1.5e-8) a step, re-added by the
# outer step; DDP's average (g0 / 2 + g1 / 2, then p - lr * avg) rounds elsewhere. Over 20 steps the parameters
# differ by a few 1e-7 (measured: max 2.7e-7); 1e-6 leaves room and still fails on any wrong sign or factor (one
# step's update is ~1e-3).
H1_TOLERANCE = 1e-6
STEPS = 20


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 33)
        self.fc2 = nn.Linear(33, 17)
        self.fc3 = nn.Linear(17, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


SMALL_BUCKETS = 0.001  # MiB: 262 floats: the 3 layers' 6 tensors in 4 buckets (each weight over it alone)


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    x, y = _batch(g)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _h1_parity(rank: int) -> dict:
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(Net())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = DiLoCo(model, DiLoCoConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                                       bucket_cap_mb=SMALL_BUCKETS))
    g_ref, g = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        _inner_step(ref, ref_opt, g_ref)
        _inner_step(model, opt, g)
        diloco.step()
    return {"diff": (_flat(ref.module) - _flat(model)).abs().max().item(),
            "update": (_flat(model) - _flat(Net())).abs().max().item()}


def _warmup_parity(rank: int) -> dict:
    """The warm-up is data parallelism: inner SGD with every step averaged (warmup_steps = STEPS, H far away)
    against torch's DDP; the default outer optimizer (Nesterov, lr 0.7) is built but never steps."""
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(Net())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diloco = DiLoCo(model, DiLoCoConfig(sync_every=50, warmup_steps=STEPS, bucket_cap_mb=SMALL_BUCKETS))
    g_ref, g = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        _inner_step(ref, ref_opt, g_ref)
        _inner_step(model, opt, g)
        diloco.step()
    return {"diff": (_flat(ref.module) - _flat(model)).abs().max().item(),
            "update": (_flat(model) - _flat(Net())).abs().max().item(),
            "momentum": len(diloco.outer_optimizer.state)}


def _run(rank: int, config: DiLoCoConfig, steps: int = STEPS) -> dict:
    """Adam inner steps under DiLoCo; the parameters after each step, which fragments landed where."""
    torch.manual_seed(rank)  # different starts: the start-up broadcast must make them equal
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model, config)
    g = torch.Generator().manual_seed(100 + rank)
    after, landed, anchors = [], [], []
    for _ in range(steps):
        _inner_step(model, opt, g)
        landed.append([s.fragment for s in diloco.step()])
        after.append(_flat(model).clone())
        anchors.append(torch.cat([a.clone() for a in diloco.anchors]))
    return {"after": after, "landed": landed, "anchors": anchors, "wire_nbytes": diloco.wire_nbytes,
            "fragments": diloco.fragments, "buckets": diloco.buckets,
            "last_sync": diloco.last_sync, "numel": sum(p.numel() for p in model.parameters())}


def _state_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


RESUME_CONFIG = DiLoCoConfig(sync_every=4, fragments=2, bucket_cap_mb=SMALL_BUCKETS)  # overlap 1


def _resume(rank: int, n: int, m: int, config: DiLoCoConfig = RESUME_CONFIG) -> dict:
    """N + M steps straight, against N steps, a save, fresh objects loaded, M steps (a fragment in flight at N)."""

    def build(seed: int):
        torch.manual_seed(seed)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, opt, DiLoCo(model, config)

    model, opt, diloco = build(rank)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n + m):
        _inner_step(model, opt, g)
        diloco.step()
    straight = _flat(model)
    model, opt, diloco = build(rank)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        _inner_step(model, opt, g)
        diloco.step()
    in_flight = len(diloco.in_flight)
    saved = _state_bytes({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": diloco.state_dict(),
                          "g": g.get_state()})
    model, opt, diloco = build(1000 + rank)  # other parameters: the load must replace them all
    state = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    diloco.load_state_dict(state["diloco"])
    g = torch.Generator()
    g.set_state(state["g"])
    for _ in range(m):
        _inner_step(model, opt, g)
        diloco.step()
    return {"straight": straight, "resumed": _flat(model), "in_flight_at_save": in_flight, "state": saved}


def _refusals() -> dict:
    """The refusals that need a model (and a group): each message, first line only."""
    out = {}
    for name, kwargs in {"fragments>parameters": dict(sync_every=20, fragments=7)}.items():
        try:
            DiLoCo(Net(), DiLoCoConfig(**kwargs))
        except ValueError as e:
            out[name] = str(e)
    state = DiLoCo(Net(), DiLoCoConfig(sync_every=5, warmup_steps=3)).state_dict()
    try:
        DiLoCo(Net(), DiLoCoConfig(sync_every=5)).load_state_dict(state)
    except ValueError as e:
        out["warmup_steps differs"] = str(e)
    return out


def _hang(rank: int) -> str:
    """Rank 1 skips the sync rank 0 waits for: rank 0 raises OuterSyncError within timeout_s."""
    group = dist.new_group([0, 1])  # its own group: the timed-out one is not reused
    model = Net()
    diloco = DiLoCo(model, DiLoCoConfig(sync_every=1, timeout_s=2.0, bucket_cap_mb=SMALL_BUCKETS), group=group)
    if rank == 1:
        import time

        time.sleep(6)  # never sends
        return ""
    try:
        diloco.step()
    except OuterSyncError as e:
        return str(e)
    return "no error"


CONFIGS = {
    "fp32": DiLoCoConfig(sync_every=5, bucket_cap_mb=SMALL_BUCKETS),
    "bf16": DiLoCoConfig(sync_every=5, wire_dtype="bf16", bucket_cap_mb=SMALL_BUCKETS),
    "fp16": DiLoCoConfig(sync_every=5, wire_dtype="fp16", bucket_cap_mb=SMALL_BUCKETS),
    "streaming": DiLoCoConfig(sync_every=6, fragments=2, bucket_cap_mb=SMALL_BUCKETS),
    "streaming_overlap2": DiLoCoConfig(sync_every=8, fragments=2, overlap_steps=2, wire_dtype="bf16",
                                       bucket_cap_mb=SMALL_BUCKETS),
    "warmup": DiLoCoConfig(sync_every=5, warmup_steps=4, bucket_cap_mb=SMALL_BUCKETS),
    "warmup_streaming": DiLoCoConfig(sync_every=6, fragments=2, warmup_steps=3, bucket_cap_mb=SMALL_BUCKETS),
}
# a save in the warm-up, resumed across its end into the outer loop (fragment 1 launched after 3 + 3, landing
# after 7; the save after step 2)
WARMUP_RESUME = DiLoCoConfig(sync_every=6, fragments=2, warmup_steps=3, bucket_cap_mb=SMALL_BUCKETS)


def _cases(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {"h1": _h1_parity(rank)}
    out.update({name: _run(rank, config) for name, config in CONFIGS.items()})
    out["resume"] = _resume(rank, n=6, m=9)
    out["warmup_parity"] = _warmup_parity(rank)
    out["resume_in_warmup"] = _resume(rank, n=2, m=12, config=WARMUP_RESUME)
    out["resume_after_warmup"] = _resume(rank, n=6, m=8, config=WARMUP_RESUME)
    out["refusals"] = _refusals()
    out["hang"] = _hang(rank)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world_size=2, timeout_s=240)


def test_h1_is_ddp_within_rounding(ranks):
    for r in ranks:
        assert r["h1"]["update"] > 1e-3  # the run moved the parameters: the check has something to compare
        assert r["h1"]["diff"] <= H1_TOLERANCE, r["h1"]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_replicas_equal_after_each_sync(ranks, name):
    a, b = ranks[0][name], ranks[1][name]
    synced = [t for t, landed in enumerate(a["landed"]) if landed]
    assert synced == [4, 9, 14, 19]  # after inner steps 5, 10, 15, 20
    assert a["landed"] == b["landed"]
    for t in range(STEPS):
        assert torch.equal(a["anchors"][t], b["anchors"][t])  # the synced copies: always equal
        if t in synced:
            assert torch.equal(a["after"][t], b["after"][t]), f"step {t + 1}"
        else:
            assert not torch.equal(a["after"][t], b["after"][t])  # between syncs each node trains on its own


def test_warmup_averages_every_step_then_syncs_every_h(ranks):
    a, b = ranks[0]["warmup"], ranks[1]["warmup"]
    synced = [t + 1 for t, landed in enumerate(a["landed"]) if landed]
    assert synced == [1, 2, 3, 4, 9, 14, 19]  # the warm-up's 4 steps, then every 5 after it
    for t in range(STEPS):
        assert torch.equal(a["anchors"][t], b["anchors"][t])
        assert torch.equal(a["after"][t], b["after"][t]) == (t + 1 in synced), f"step {t + 1}"
    assert a["wire_nbytes"] == 7 * a["numel"] * 4  # each warm-up step carries DDP's bytes, once


def test_warmup_with_streaming_lands_each_fragment_once_a_cycle(ranks):
    a, b = ranks[0]["warmup_streaming"], ranks[1]["warmup_streaming"]
    # warm-up: both fragments after steps 1-3; then fragment 1 launched after 3 + 3k (k >= 1), fragment 0 after
    # 3 + 6k, each landed one step later
    expected = [[0, 1]] * 3 + [sorted(k for k in range(2) if t - 1 - 3 > 0 and (t - 1 - 3 - 3 * k) % 6 == 0
                                      and t - 1 - 3 >= 3 * k) for t in range(4, STEPS + 1)]
    assert a["landed"] == expected == b["landed"]
    bounds = _fragment_bounds(a)
    for t in range(STEPS):
        for k in a["landed"][t]:
            lo, hi = bounds[k]
            assert torch.equal(a["after"][t][lo:hi], b["after"][t][lo:hi]), f"fragment {k} at step {t + 1}"


def test_warmup_is_ddp_within_rounding(ranks):
    for r in ranks:
        assert r["warmup_parity"]["update"] > 1e-3
        assert r["warmup_parity"]["diff"] <= H1_TOLERANCE, r["warmup_parity"]
        assert r["warmup_parity"]["momentum"] == 0  # the outer optimizer never stepped in the warm-up


def test_wire_bytes(ranks):
    fp32, bf16, fp16 = (ranks[0][k] for k in ("fp32", "bf16", "fp16"))
    numel = fp32["numel"]
    assert fp32["wire_nbytes"] == 4 * numel * 4  # 4 syncs of every parameter at 4 bytes
    assert bf16["wire_nbytes"] == fp16["wire_nbytes"] == 4 * numel * 2
    assert fp32["last_sync"].wire_nbytes == 4 * numel and fp32["last_sync"].landed_at == 20
    assert len(fp32["buckets"]) == 4


def test_half_wires_stay_close_to_fp32(ranks):
    fp32 = ranks[0]["fp32"]["after"][-1]
    for name in ("bf16", "fp16"):
        diff = (ranks[0][name]["after"][-1] - fp32).abs().max().item()
        assert 0 < diff < 0.05, (name, diff)


@pytest.mark.parametrize("name", ["streaming", "streaming_overlap2"])
def test_streaming_fragments_equal_when_they_land(ranks, name):
    a, b = ranks[0][name], ranks[1][name]
    config = CONFIGS[name]
    assert len(a["fragments"]) == 2
    overlap = config.overlap
    # fragment 1 launches after steps H/2, 3H/2, ...; fragment 0 after H, 2H; each lands overlap steps later
    expected = [sorted(k for k in range(2) if t + 1 - overlap in
                       [s for s in range(1, STEPS + 1) if k in config.launches_at(s)]) for t in range(STEPS)]
    assert a["landed"] == expected == b["landed"]
    numels = [sum(a["buckets"][bk].__len__() for bk in f) for f in a["fragments"]]
    assert all(numels)
    bounds = _fragment_bounds(a)
    for t in range(STEPS):
        assert torch.equal(a["anchors"][t], b["anchors"][t])
        for k in a["landed"][t]:
            lo, hi = bounds[k]
            assert torch.equal(a["after"][t][lo:hi], b["after"][t][lo:hi]), f"fragment {k} at step {t + 1}"
            assert torch.equal(a["after"][t][lo:hi], a["anchors"][t][lo:hi])  # the synced copy, in the model


def _fragment_bounds(result: dict) -> list[tuple[int, int]]:
    """Each fragment's slice of the flat parameters (buckets hold consecutive parameters in model order)."""
    sizes = [p.numel() for p in Net().parameters()]
    bounds, start = [], 0
    for fragment in result["fragments"]:
        n = sum(sizes[i] for b in fragment for i in result["buckets"][b])
        bounds.append((start, start + n))
        start += n
    return bounds


def test_resume_bit_for_bit(ranks):
    for r in ranks:
        assert r["resume"]["in_flight_at_save"] == 1  # fragment 1 launched after step 6, lands after 7
        assert torch.equal(r["resume"]["straight"], r["resume"]["resumed"])
        for name in ("resume_in_warmup", "resume_after_warmup"):
            assert torch.equal(r[name]["straight"], r[name]["resumed"]), name
        assert r["resume_after_warmup"]["in_flight_at_save"] == 1  # fragment 1, launched after 6, lands after 7


def test_bad_arguments_refused_in_one_line(ranks):
    refusals = ranks[0]["refusals"]
    assert "DiLoCoConfig.fragments=7 is more than the 6 parameter tensors" in refusals["fragments>parameters"]
    assert refusals["warmup_steps differs"] == ("DiLoCo.load_state_dict: the state was saved with "
                                                "DiLoCoConfig.warmup_steps=3, this DiLoCo has 0: the outer schedule "
                                                "would shift")
    for message in refusals.values():
        assert "\n" not in message


@pytest.mark.parametrize("kwargs, field", [
    (dict(sync_every=0), "DiLoCoConfig.sync_every must be an int >= 1, got 0"),
    (dict(sync_every=True), "DiLoCoConfig.sync_every must be an int >= 1"),
    (dict(sync_every=10, fragments=0), "DiLoCoConfig.fragments must be an int >= 1"),
    (dict(sync_every=2, fragments=3), "DiLoCoConfig.fragments=3 must be <= sync_every=2"),
    (dict(sync_every=10, wire_dtype="int8"), "DiLoCoConfig.wire_dtype must be one of ['bf16', 'fp16', 'fp32']"),
    (dict(sync_every=10, outer_lr=-1.0), "DiLoCoConfig.outer_lr must be a finite number >= 0"),
    (dict(sync_every=10, outer_momentum=0.0), "DiLoCoConfig.nesterov=True needs outer_momentum > 0"),
    (dict(sync_every=10, overlap_steps=10), "DiLoCoConfig.overlap_steps=10 must be < sync_every // fragments"),
    (dict(sync_every=10, fragments=2, overlap_steps=5), "DiLoCoConfig.overlap_steps=5 must be <"),
    (dict(sync_every=10, bucket_cap_mb=0), "DiLoCoConfig.bucket_cap_mb must be a number > 0"),
    (dict(sync_every=10, timeout_s=0), "DiLoCoConfig.timeout_s must be None or a number > 0"),
    (dict(sync_every=10, warmup_steps=-1), "DiLoCoConfig.warmup_steps must be an int >= 0, got -1"),
    (dict(sync_every=10, warmup_steps=2.5), "DiLoCoConfig.warmup_steps must be an int >= 0, got 2.5"),
    (dict(sync_every=10, warmup_steps=True), "DiLoCoConfig.warmup_steps must be an int >= 0, got True"),
])
def test_config_refuses_in_one_line(kwargs, field):
    with pytest.raises(ValueError) as info:
        DiLoCoConfig(**kwargs)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_hang_names_the_outer_all_reduce(ranks):
    message = ranks[0]["hang"]
    assert message.startswith("DiLoCo: the outer all-reduce of fragment 0 (bucket 1 of 4, launched after inner "
                              "step 1) failed after"), message
    assert "\n" not in message


def test_schedule_and_buckets():
    config = DiLoCoConfig(sync_every=8, fragments=4)
    assert [config.offset(k) for k in range(4)] == [0, 2, 4, 6]
    assert [s for s in range(1, 20) if config.launches_at(s)] == [2, 4, 6, 8, 10, 12, 14, 16, 18]
    assert config.launches_at(8) == [0] and config.launches_at(10) == [1]
    warm = DiLoCoConfig(sync_every=8, fragments=4, warmup_steps=5)
    assert [s for s in range(1, 9) if warm.averages_at(s)] == [1, 2, 3, 4, 5]
    assert [s for s in range(1, 20) if warm.launches_at(s)] == [7, 9, 11, 13, 15, 17, 19]
    assert warm.launches_at(13) == [0] and warm.launches_at(7) == [1]
    assert assign_buckets([5, 5, 20, 1, 1], 10) == [[0, 1], [2], [3, 4]]
    assert assign_fragments([429, 33, 561, 17, 85, 5], 2) == [[0, 1], [2, 3, 4, 5]]
    assert assign_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert assign_fragments([100, 1, 1], 3) == [[0], [1], [2]]
    assert assign_fragments([1, 1, 100], 2) == [[0, 1], [2]]


def _resume_at_one_rank(rank: int, world_size: int, saved: bytes) -> dict:
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = DiLoCoConfig(sync_every=4, fragments=2, bucket_cap_mb=SMALL_BUCKETS)
    diloco = DiLoCo(model, config)
    state = torch.load(io.BytesIO(saved), weights_only=True)
    diloco.load_state_dict(state["diloco"])
    opt.load_state_dict(state["opt"])  # rank 0's inner optimizer: the one a resized run keeps
    diloco.reset_to_global()
    start = _flat(model).clone()
    anchors = torch.cat([a.clone() for a in diloco.anchors])
    g = torch.Generator().manual_seed(7)
    landed = []
    for _ in range(6):
        _inner_step(model, opt, g)
        landed += [(s.fragment, s.landed_at) for s in diloco.step()]
    return {"start": start, "anchors": anchors, "landed": landed, "end": _flat(model),
            "synced": torch.cat([a.clone() for a in diloco.anchors])}


def test_resume_at_another_world_size(ranks):
    [one] = run_ranks(_resume_at_one_rank, world_size=1, args=(ranks[0]["resume"]["state"],))
    assert torch.equal(one["start"], one["anchors"])  # the model starts from the synced copy
    # the 2-rank run stopped after inner step 6 with fragment 1 in flight: it lands after 7 at 1 rank, and the
    # schedule goes on from step 6 (fragment 0 launched after 8, landing after 9; fragment 1 after 10, landing
    # after 11)
    assert one["landed"] == [(1, 7), (0, 9), (1, 11)]
    assert torch.isfinite(one["end"]).all()
