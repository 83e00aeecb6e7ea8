"""``lockstep plan``: the memory arithmetic, the alpha-beta formulas, the
recommendations, and the model's all-reduce prediction against two real gloo
ranks on this machine."""

from __future__ import annotations

import dataclasses

import statistics
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from lockstep.costmodel import LINKS, Link, allreduce_time_s, fit_link
from lockstep.perf.plan import PlanConfig, cli_main, comm_time_s, format_plan, make_plan, min_world_size, step_time_s


def test_textbook_7b_mixed_adam_needs_112_gb_and_does_not_fit_80():
    plan = make_plan(PlanConfig(params=7e9, precision="mixed", optimizer="adam", world_size=8,
                                device_memory_gb=80, link="nvlink"))
    m = plan.memory_gb
    assert (m["weights"], m["gradients"], m["master_weights"], m["optimizer_state"]) == pytest.approx((14, 14, 28, 56))
    assert m["total"] == pytest.approx(112.0)  # 16 bytes per parameter
    assert not plan.fits
    # ZeRO-1 at N=8: 14 + 14 + (28 + 56) / 8 = 38.5 GB, which fits: the first stage that fits is recommended.
    assert plan.sharded_memory_gb["zero1"] == pytest.approx(38.5)
    assert "Does not fit" in plan.recommendation and "ZeRO-1" in plan.recommendation


def test_cli_prints_the_breakdown_and_verdict(capsys):
    assert cli_main(["--params", "7e9", "--precision", "mixed", "--optimizer", "adam", "--world-size", "8",
                     "--device-memory-gb", "80", "--link", "nvlink"]) == 0
    out = capsys.readouterr().out
    assert "112.00" in out and "fits in 80 GB: NO" in out and "1024" in out and "ZeRO" in out


def test_sharding_does_not_help_when_even_fsdp_is_too_big():
    plan = make_plan(PlanConfig(params=70e9, world_size=8, device_memory_gb=80, link="ib-hdr"))
    assert plan.memory_gb["total"] == pytest.approx(1120.0)
    assert plan.sharded_memory_gb["zero3_fsdp"] == pytest.approx(140.0)
    assert "FSDP needs N >= 14" in plan.recommendation  # ceil(1120 / 80)


def test_fp32_sgd_bytes_per_parameter():
    m = make_plan(PlanConfig(params=1e9, precision="fp32", optimizer="sgd", world_size=2)).memory_gb
    assert m["total"] == pytest.approx(12.0)  # 4 weights + 4 grads + 4 momentum
    m = make_plan(PlanConfig(params=1e9, precision="bf16", optimizer="sgd-nomomentum", world_size=2)).memory_gb
    assert m["total"] == pytest.approx(4.0)


def test_ring_and_tree_formulas():
    link = Link("test", alpha_s=10e-6, bandwidth_gb_s=2.0)
    nbytes = 100e6
    for n in (2, 3, 4, 8):
        ring = 2 * (n - 1) * 10e-6 + 2 * (n - 1) / n * nbytes / 2e9
        assert allreduce_time_s(nbytes, n, link, "ring") == pytest.approx(ring)
    assert allreduce_time_s(nbytes, 8, link, "tree") == pytest.approx(3 * (10e-6 + nbytes / 2e9))
    assert allreduce_time_s(nbytes, 6, link, "tree") == pytest.approx(4 * (10e-6 + nbytes / 2e9))  # 2 + 2 folds
    assert allreduce_time_s(nbytes, 1, link, "ring") == 0.0
    # Bucketing: 100 MB of fp32 gradients in 25 MiB buckets = 4 buckets (3 full + 1 partial) of latency.
    cfg = PlanConfig(params=25e6, precision="fp32", world_size=4, link=link, bucket_cap_mb=25)
    assert comm_time_s(cfg, 4, "ring") == pytest.approx(4 * 6 * 10e-6 + 1.5 * nbytes / 2e9)


def test_fit_link_recovers_alpha_and_beta():
    link = Link("truth", alpha_s=40e-6, bandwidth_gb_s=1.7)
    sizes = [4096 * 4**k for k in range(8)]
    for algo, n in (("ring", 2), ("ring", 4), ("tree", 3)):
        fitted = fit_link(sizes, [allreduce_time_s(s, n, link, algo) for s in sizes], n, algo)
        assert fitted.alpha_s == pytest.approx(40e-6, rel=1e-6) and fitted.bandwidth_gb_s == pytest.approx(1.7, rel=1e-6)
    with pytest.raises(ValueError, match="grow with size"):
        fit_link(sizes[:3], [1.0, 0.9, 0.8], 2)


def test_step_time_overlap_and_scaling_efficiency():
    cfg = PlanConfig(params=120e6, world_size=8, link="10gbe", compute_ms=150.0)
    plan = make_plan(cfg)
    s = plan.step_ms
    assert s["compute"] < s["overlap"] < s["no_overlap"]
    assert s["no_overlap"] == pytest.approx(150.0 + plan.comm_ms[s["algorithm"]])
    effs = [row["efficiency"] for row in plan.scaling]
    assert [row["world_size"] for row in plan.scaling] == [2**k for k in range(11)]
    assert effs[0] == 1.0 and all(a >= b for a, b in zip(effs, effs[1:]))
    assert "accumulate gradients over" in plan.recommendation
    # One bucket: nothing to overlap with, so both step times agree.
    one = PlanConfig(params=1e6, precision="fp32", world_size=2, link="10gbe", compute_ms=10.0, bucket_cap_mb=100)
    plain, overlapped = step_time_s(one, 0.005)
    assert plain == pytest.approx(overlapped) == pytest.approx(0.015)
    fast = make_plan(PlanConfig(params=120e6, world_size=8, link="nvlink", compute_ms=150.0))
    assert "plain DDP" in fast.recommendation and fast.step_ms["efficiency"] > 0.9


def test_plan_says_whether_the_overlapped_step_and_fp16_pay_on_a_slow_link():
    from lockstep.costmodel import Link
    from lockstep.perf.plan import overlapped_step_time_s

    # issue #35's link MLP at 1 Gbit/s (0.125 GB/s): compute 120 ms, a 41 MB all-reduce ~330 ms on the wire.
    gbit = Link("1gbit", 100e-6, 0.125)
    cfg = PlanConfig(params=10.26e6, precision="fp32", optimizer="sgd", world_size=2, link=gbit, compute_ms=120.0,
                     bucket_cap_mb=8)
    plan = make_plan(cfg)
    s = plan.step_ms
    comm_s = plan.comm_ms[s["algorithm"]] / 1e3
    assert s["overlap_step"] == pytest.approx(overlapped_step_time_s(cfg, comm_s) * 1e3)
    assert s["overlap_step"] == pytest.approx((comm_s + 0.120 / 5) * 1e3)  # 5 buckets of 8 MiB: one's compute left
    assert s["fp16"] < s["overlap"] and s["overlap_step"] < s["overlap"]
    assert "overlap_optimizer_step(opt) (the same bits)" in plan.recommendation
    assert "the fp16 compress hook" in plan.recommendation and ": pays" in plan.recommendation
    # compute-bound: the overlapped step is the compute, nothing to gain
    quick = dataclasses.replace(cfg, link=Link("fast", 1e-6, 100.0))
    assert overlapped_step_time_s(quick, 0.0005) == pytest.approx(0.120)


def tiny_model():
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))


def test_model_given_as_module_factory():
    assert PlanConfig(model="test_plan:tiny_model").params == 10 * 20 + 20 + 20 * 3 + 3
    with pytest.raises(ValueError, match="model"):
        PlanConfig(model="test_plan:no_such_factory")


@pytest.mark.parametrize("kwargs, field", [
    (dict(params=-1), "params"),
    (dict(params=1e9, precision="fp8"), "precision"),
    (dict(params=1e9, optimizer="lion"), "optimizer"),
    (dict(params=1e9, world_size=0), "world_size"),
    (dict(params=1e9, device_memory_gb=0), "device_memory_gb"),
    (dict(params=1e9, link="carrier-pigeon"), "link"),
    (dict(params=1e9, compute_ms=-5), "compute_ms"),
    (dict(params=1e9, bucket_cap_mb=0), "bucket_cap_mb"),
    (dict(), "exactly one of `params` and `model`"),
    (dict(params=1e9, model="x:y"), "exactly one of `params` and `model`"),
    (dict(model="no_colon"), "PlanConfig.model"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PlanConfig(**kwargs)


@pytest.mark.parametrize("argv, flag", [
    (["--params", "-5"], "--params"),
    (["--params", "nan"], "--params"),
    (["--params", "7e9", "--world-size", "0"], "--world-size"),
    (["--params", "7e9", "--device-memory-gb", "-1"], "--device-memory-gb"),
    (["--params", "7e9", "--device-memory-gb", "inf"], "--device-memory-gb"),
    (["--params", "7e9", "--compute-ms", "0"], "--compute-ms"),
    (["--params", "7e9", "--activation-gb", "-1"], "--activation-gb"),
    (["--params", "7e9", "--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    (["--params", "7e9", "--alpha-us", "-1"], "--alpha-us"),
    (["--params", "7e9", "--bandwidth-gb-s", "0"], "--bandwidth-gb-s"),  # was taken as "not given"
    (["--model", "no_colon"], "--model"),
    (["--model", "no_such_module_here:build"], "--model"),
    (["--model", "test_plan:failing_factory"], "--model"),
])
def test_cli_errors_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith(f"lockstep plan: error: argument {flag}: "), last
    assert "PlanConfig" not in last and "Link." not in last


def failing_factory():
    raise RuntimeError("the factory broke")


def test_fits_is_never_claimed_without_saying_activations_are_not_counted(capsys):
    assert cli_main(["--params", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "fits in 80 GB: yes, before activations (64.00 GB left for them)" in out
    assert "\n  activations are not counted: unknown (pass --activation-gb" in out
    assert "recommendation: Fits before activations (16.0 of 80 GB, 64.0 GB left for them; pass --activation-gb)" in out
    assert "fits in 80 GB: yes\n" not in out
    assert cli_main(["--params", "1e9", "--activation-gb", "10", "--json"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    assert plan["activations_counted"] and plan["fits"] and plan["memory_gb"]["total"] == pytest.approx(26.0)
    assert plan["recommendation"].startswith("Fits (26.0 of 80 GB)")
    assert make_plan(PlanConfig(params=1e9)).activations_counted is False


def test_plan_says_how_to_get_zero_with_lockstep(capsys):
    # "Does not fit" becomes the first stage that fits at this N, its GB per rank, its wire cost and the lockstep
    # call that gives it (tests/test_zero.py proves lockstep.ZeroRedundancyOptimizer bit for bit).
    assert cli_main(["--params", "7e9"]) == 0
    out = capsys.readouterr().out
    rec = out[out.index("recommendation:"):]
    assert rec.startswith("recommendation: Does not fit: 112.0 GB per replica > 80 GB. Fits with ZeRO-1 (shard "
                          "optimizer state) at N=8: 38.5 GB per rank, +50% bytes on the wire")
    assert "how: opt = lockstep.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, " in rec
    assert "lockstep.DistributedDataParallel" in rec and "before activations, which are not counted" in rec
    assert "torch.distributed.optim" not in out  # lockstep's own class now, not torch's
    assert "  ZeRO-1 with lockstep: opt = lockstep.ZeroRedundancyOptimizer(" in out
    assert ("  ZeRO-2 with lockstep: opt = model.zero_optimizer(torch.optim.Adam, stage=2, lr=...) with model = "
            "lockstep.DistributedDataParallel(...) (DistributedDataParallel.zero_optimizer)") in out
    fsdp = make_plan(PlanConfig(params=70e9, world_size=8, device_memory_gb=80, link="ib-hdr")).recommendation
    assert "fully_shard" in fsdp and "ZeRO-2" not in fsdp  # its unsharded weights (140 GB) fit no device


def test_plan_names_zero2_where_zero1_does_not_fit():
    # 7e9 mixed Adam at N=8 on 30 GB: ZeRO-1 needs 14 + 14 + 84/8 = 38.5, ZeRO-2 14 + 98/8 = 26.25.
    rec = make_plan(PlanConfig(params=7e9, world_size=8, device_memory_gb=30, optimizer="adamw",
                               activation_gb=0)).recommendation
    assert rec.startswith("Does not fit: 112.0 GB per replica > 30 GB. Fits with ZeRO-2 (shard gradients and "
                          "optimizer state) at N=8: 26.2 GB per rank, the same bytes on the wire as DDP")
    assert "how: opt = model.zero_optimizer(torch.optim.AdamW, stage=2, lr=...)" in rec
    assert "before activations" not in rec


def test_plan_says_at_which_n_zero2_fits_where_only_fsdp_does():
    # On 20 GB only FSDP fits at N=8 (14 GB); ZeRO-2 keeps the 14 GB of weights and shards 98: N >= ceil(98/6) = 17.
    plan = make_plan(PlanConfig(params=7e9, world_size=8, device_memory_gb=20, activation_gb=0))
    assert "Fits with ZeRO-3 / FSDP (shard everything) at N=8: 14.0 GB per rank" in plan.recommendation
    assert "\n  or ZeRO-2 with lockstep at N >= 17: 19.8 GB per rank (opt = model.zero_optimizer(" in plan.recommendation
    assert min_world_size(plan, "zero2") == 17 and min_world_size(plan, "zero1") is None  # 28 GB kept > 20
    # Not even FSDP at N=2 (320 GB over 2 x 80): ZeRO-2 would at N >= 7 (40 + 280/7 = 80 GB).
    rec = make_plan(PlanConfig(params=20e9, world_size=2, device_memory_gb=80, activation_gb=0)).recommendation
    assert rec.startswith("Does not fit even fully sharded at N=2: FSDP needs N >= 4 devices")
    assert "or ZeRO-2 with lockstep at N >= 7: 80.0 GB per rank" in rec


def test_plan_fits_without_sharding_names_no_zero():
    rec = make_plan(PlanConfig(params=1e9, activation_gb=10)).recommendation
    assert rec.startswith("Fits (26.0 of 80 GB)") and "ZeRO" not in rec


# --- the model against this machine -------------------------------------------------

SIZES_MIB = [1, 2, 4, 8, 16]


def _measure(rank: int, world_size: int, iters: int):
    """Seconds per ring all-reduce, one row per iteration, one column per size.

    Both ranks run on this host and share its monotonic clock, so a call's time
    is the last rank's finish minus the last rank's start: no barrier skew. Sizes
    are interleaved inside each iteration (rotating which goes first), so load
    from other processes on this shared 2-core machine hits them all alike.
    """
    from lockstep.collectives import all_reduce

    bufs = {mib: torch.zeros(mib << 18) for mib in SIZES_MIB}
    starts = torch.zeros(iters + 1, len(SIZES_MIB), dtype=torch.float64)
    ends = torch.zeros_like(starts)
    for i in range(iters + 1):  # the first pass is warm-up
        for step in range(len(SIZES_MIB)):
            j = (i + step) % len(SIZES_MIB)
            dist.barrier()
            starts[i, j] = time.perf_counter()
            all_reduce(bufs[SIZES_MIB[j]], algorithm="ring")
            ends[i, j] = time.perf_counter()
    dist.all_reduce(starts, op=dist.ReduceOp.MAX)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    return (ends - starts)[1:].tolist()


def _measure_s() -> list[float]:
    """Lower-quartile time per size: interference from other processes only ever
    adds time, so the lower quartile estimates the all-reduce's own cost (the
    median moves by a third when the other sessions on this box are busy)."""
    rows = run_ranks(_measure, world_size=2, args=(60,), timeout_s=120)[0]
    return [statistics.quantiles(column, n=4)[0] for column in zip(*rows)]


@pytest.fixture(scope="module")
def measured_s():
    return _measure_s()


def _predict_s(link: Link, nbytes: int) -> float:
    # Through the plan itself: fp32 gradients of nbytes in one bucket on 2 ranks.
    cfg = PlanConfig(params=nbytes / 4, precision="fp32", world_size=2, link=link, bucket_cap_mb=1024)
    return comm_time_s(cfg, 2, "ring")


def test_plan_predicts_measured_allreduce_within_30_percent(measured_s):
    """alpha and beta are fitted in this run (the box is shared, so a fit made an
    hour ago describes another load); two parameters must then explain five sizes
    over a 16x range: the test fails if time is not affine in size or if the
    plan's ring arithmetic (bucketing, 2(N-1) latencies, 2(N-1)/N bytes) is off."""
    misses = []
    # Up to three measurements, each fitted on its own: under CI's load one run of 60 rounds measured 1 MiB slower
    # than 2 MiB (1.94 against 1.53 ms, 2026-11-26), which no affine time explains; other processes' load is not
    # affine in size and passes, while wrong arithmetic misses every time.
    for attempt in range(3):
        times_s = measured_s if attempt == 0 else _measure_s()
        sizes = [mib << 20 for mib in SIZES_MIB]
        link = fit_link(sizes, times_s, 2, "ring")
        errors = {nbytes >> 20: _predict_s(link, nbytes) / t - 1 for nbytes, t in zip(sizes, times_s)}
        if all(abs(e) <= 0.30 for e in errors.values()):
            return
        misses.append(f"prediction error by MiB: {errors}; measured {times_s}; fit {link}")
    raise AssertionError("the fit missed in 3 measurements:\n" + "\n".join(misses))


def test_loopback_preset_is_the_right_order_of_magnitude(measured_s):
    # The preset was measured on this machine under another load: a factor of 3
    # catches unit slips (bits/bytes, MB/MiB, us/ms) without failing on noise.
    # Only the sizes where bandwidth dominates: latency on a shared 2-core box
    # swings tenfold with load (a rank waits for a time slice to wake up).
    for mib, t in zip(SIZES_MIB, measured_s):
        if mib < 8:
            continue
        ratio = _predict_s(LINKS["loopback"], mib << 20) / t
        assert 1 / 3 <= ratio <= 3, f"{mib} MiB: loopback preset predicts {ratio:.2f}x the measured {t * 1e3:.2f} ms"


def test_plan_says_at_which_h_diloco_stops_being_dominated_by_the_link(capsys):
    # issue #44's case: the 10.3M MLP at 100 Mbit/s (12.5 MB/s), ~0.1 s of compute a step: an fp32 outer sync of
    # 41.2 MB takes ~3.3 s, so H >= 33 for the sync to cost at most the compute, H >= 330 for 10%
    from lockstep.costmodel import diloco_sync_every_for

    assert diloco_sync_every_for(3.3, 0.1) == 33 and diloco_sync_every_for(3.3, 0.1, 0.1) == 330
    assert diloco_sync_every_for(0.01, 0.1) == 1
    link = Link("100mbit", 100e-6, 0.0125)
    plan = make_plan(PlanConfig(params=10.3e6, precision="fp32", world_size=2, link=link, compute_ms=100))
    assert plan.diloco is not None and 3200 < plan.diloco["sync_ms"] < 3400
    assert plan.diloco["h_dominates"] == 33 and plan.diloco["h_10_percent"] == 330
    assert make_plan(PlanConfig(params=10.3e6, world_size=2, link=link)).diloco is None  # no compute_ms
    assert "communication stops dominating at sync_every (H) >= 33" in format_plan(plan)
