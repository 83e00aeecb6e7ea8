"""``benchmarks/link.py``'s pure parts, from given numbers: the limits, the paired ratios, the table, the rate
parsing, the slow-rate schedule and the Chrome trace. The run itself needs root and two namespaces (minutes at
each rate); its skip message is not tested here (the tests run as root)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def link():
    sys.path.insert(0, str(BENCH))
    try:
        import link as module
    finally:
        sys.path.remove(str(BENCH))
    return module


# Two blocks: the 1 Gbit/s MLP figures, then a block where the machine ran 10% slower.
BLOCKS = {
    "forward": [42.0, 46.2], "compute": [120.0, 132.0], "allreduce": [345.0, 379.5],
    "torch": [435.0, 478.5], "lockstep": [433.0, 460.0], "torch_fp16": [307.0, 330.0], "lockstep_fp16": [260.0, 300.0],
}


def test_limits_are_taken_per_block_and_summarised(link):
    table = link.link_table(BLOCKS)
    assert table["measured_ms"] == {"forward": 44.1, "compute": 126.0, "allreduce": 362.25}
    lim = table["limits_ms"]
    # DDP limit max(compute, forward + all-reduce): 387 and 425.7; wire limit max(compute, all-reduce): 345, 379.5.
    assert lim["ddp"] == pytest.approx((387.0 + 425.7) / 2)
    assert lim["wire"] == pytest.approx((345.0 + 379.5) / 2)
    # fp16 halves the all-reduce: 42 + 172.5 = 214.5; the wire's half (172.5) against compute 120.
    assert lim["ddp_fp16"] == pytest.approx((214.5 + 235.95) / 2)
    assert lim["wire_fp16"] == pytest.approx((172.5 + 189.75) / 2)


def test_each_contender_is_paired_block_by_block_with_its_own_limits_and_torch(link):
    rows = link.link_table(BLOCKS)["contenders"]
    assert list(rows) == ["torch", "torch_fp16", "lockstep", "lockstep_fp16"]  # CONTENDERS' order
    torch_row = rows["torch"]
    assert torch_row["ms"] == pytest.approx(456.75)
    assert torch_row["ddp_limit"]["median"] == pytest.approx(435 / 387)  # both blocks 1.124: paired, drift cancels
    assert torch_row["ddp_limit"]["min"] == pytest.approx(435 / 387) and torch_row["torch"]["median"] == 1.0
    lockstep = rows["lockstep"]
    assert lockstep["ddp_limit"]["min"] == pytest.approx(460 / 425.7)
    assert lockstep["ddp_limit"]["max"] == pytest.approx(433 / 387)
    assert lockstep["wire_limit"]["max"] == pytest.approx(433 / 345)
    assert lockstep["torch"]["min"] == pytest.approx(460 / 478.5) and lockstep["torch_ref"] == "torch"
    fp16 = rows["lockstep_fp16"]
    assert fp16["limits"] == "fp16" and fp16["torch_ref"] == "torch_fp16"
    assert fp16["ddp_limit"]["min"] == pytest.approx(260 / 214.5)  # the 1.21
    assert fp16["torch"]["max"] == pytest.approx(300 / 330)
    assert link.torch_reference("lockstep_powersgd") == "torch_powersgd"


def test_without_torch_there_is_no_torch_ratio_and_the_table_says_so(link):
    blocks = {k: v for k, v in BLOCKS.items() if k not in ("torch", "torch_fp16")}
    table = link.link_table(blocks)
    assert "torch" not in table["contenders"]["lockstep"]
    lines = link.markdown_section("1gbit, mlp", table)
    assert lines[0] == "### 1gbit, mlp"
    assert "DDP limit max(compute, forward + all-reduce) 406.4 ms" in lines[2]
    row = next(line for line in lines if line.startswith("| lockstep |"))
    assert row == "| lockstep | 446.5 | 1.100 [1.081-1.119] | 1.234 [1.212-1.255] | - | - | fp32 | - |"


def test_the_cpu_limit_is_the_compute_beside_the_wire_where_it_exceeds_forward_and_all_reduce(link):
    """A compute-bound model (the CNN at 1 Gbit/s): the wire's CPU work slows the compute beside it, and the CPU
    limit max(compute_wire, forward + all-reduce) is taken per block; the fp16 rows get none."""
    blocks = {"forward": [28.0, 30.0], "compute": [76.0, 80.0], "compute_wire": [100.0, 110.0],
              "allreduce": [40.0, 42.0], "lockstep": [108.0, 115.5], "lockstep_fp16": [90.0, 95.0]}
    table = link.link_table(blocks)
    assert table["limits_ms"]["cpu"] == 105.0 and table["limits_ms"]["ddp"] == 78.0
    assert table["contenders"]["lockstep"]["cpu_limit"] == {"median": 1.065, "min": 1.05, "max": 1.08}
    assert "cpu_limit" not in table["contenders"]["lockstep_fp16"]
    lines = link.markdown_section("1gbit, cnn", table)
    assert "compute beside an all-reduce of the gradients' bytes 105.0 ms (1.35 x alone): CPU limit" in "\n".join(lines)
    row = next(line for line in lines if line.startswith("| lockstep |"))
    assert "| 1.065 [1.050-1.080] |" in row


def test_the_plan_column_is_lockstep_plans_step_on_the_measured_link(link):
    from lockstep.perf.plan import PlanConfig, overlapped_step_time_s, step_time_s

    blocks = dict(BLOCKS, floor=[470.0, 510.0], lockstep_overlap=[380.0, 400.0])
    table = link.link_table(blocks, nbytes=41.0e6, world_size=2)
    m = table["measured_ms"]
    rows = table["contenders"]
    cfg_comm_s = m["allreduce"] / 1e3
    # the fitted link reproduces the measured all-reduce, so the plan's DDP step is its overlap formula on it
    cfg = PlanConfig(params=41.0e6 / 4, precision="fp32", world_size=2, compute_ms=m["compute"])
    assert rows["lockstep"]["plan_ms"] == pytest.approx(step_time_s(cfg, cfg_comm_s)[1] * 1e3)
    assert rows["floor"]["plan_ms"] == pytest.approx(m["compute"] + m["allreduce"])
    assert rows["lockstep_overlap"]["plan_ms"] == pytest.approx(overlapped_step_time_s(cfg, cfg_comm_s) * 1e3)
    assert rows["lockstep_fp16"]["plan_ms"] == pytest.approx(step_time_s(cfg, cfg_comm_s / 2)[1] * 1e3)
    row = next(line for line in link.markdown_section("t", table) if line.startswith("| lockstep |"))
    plan = rows["lockstep"]["plan_ms"]
    assert row.endswith(f"| {plan:.1f} ({rows['lockstep']['ms'] / plan:.3f}) |")


def test_the_auto_cap_is_compared_with_the_best_fixed_cap_of_the_sweep(link):
    assert link.cap_of("lockstep_cap4") == 4.0 and link.cap_of("lockstep_cap0.5") == 0.5
    assert link.cap_of("lockstep") is None and link.cap_of("lockstep_capx") is None
    blocks = dict(BLOCKS, lockstep_auto=[420.0, 440.0], lockstep_cap4=[400.0, 420.0], lockstep_cap100=[450.0, 470.0])
    table = link.link_table(blocks)
    assert list(table["contenders"])[-2:] == ["lockstep_cap4", "lockstep_cap100"]
    lines = link.markdown_section("t", table)
    assert "lockstep_auto / the best fixed cap of the sweep (lockstep_cap4): 1.049" in lines


def test_rates_and_the_slow_schedule(link):
    assert link.rate_bits("100mbit") == 1e8 and link.rate_bits("2.5gbit") == 2.5e9 and link.rate_bits("800kbit") == 8e5
    with pytest.raises(ValueError, match="rate '1gbps' must look like"):
        link.rate_bits("1gbps")
    defaults = SimpleNamespace(blocks=None, block_steps=None)
    assert link.schedule("1gbit", defaults) == (4, 4, "")
    blocks, steps, note = link.schedule("100mbit", defaults)
    assert (blocks, steps) == (2, 2) and "2 blocks of 2 steps at 100mbit" in note
    assert link.schedule("100mbit", SimpleNamespace(blocks=3, block_steps=None)) == (3, 4, "")


def test_bad_flags_exit_2_naming_the_flag(link, capsys):
    for argv, says in ((["--rates", "1gbps"], "--rates: rate '1gbps'"),
                       (["--models", "vgg"], "--models: unknown model"),
                       (["--ranks-per-node", "0"], "--ranks-per-node must be >= 1")):
        with pytest.raises(SystemExit) as e:
            link.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_chrome_trace_puts_compute_first_and_times_from_the_first_span(link):
    spans = [("all-reduce bucket 0", "bucket 0", 1.05, 1.40, {"nbytes_fp32": 4}),
             ("forward", "compute", 1.0, 1.04, {}), ("backward", "compute", 1.04, 1.12, {})]
    trace = link.chrome_trace(spans)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "compute", 1: "bucket 0"}
    spans_out = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans_out["forward"]["ts"] == 0 and spans_out["forward"]["tid"] == 0
    assert spans_out["all-reduce bucket 0"]["ts"] == pytest.approx(50_000)
    assert spans_out["all-reduce bucket 0"]["dur"] == pytest.approx(350_000)


def test_link_bytes_line_gives_each_entry_as_a_multiple_of_the_gradients(link):
    res = {"nbytes": 41_000_000, "lockstep_hierarchical": True, "link_nbytes_per_step": link.per_step(
        {"forward": 0, "allreduce": 61_500_000, "lockstep": 41_100_000, "lockstep_flat": 61_500_000})}
    line = link._link_bytes_line(res)
    assert "lockstep's default was hierarchical here" in line
    assert line.endswith("allreduce 61.5 MB (1.50 x), lockstep 41.1 MB (1.00 x), lockstep_flat 61.5 MB (1.50 x).")
    assert "lockstep_flat" in link.CONTENDERS  # the flat ring beside the hierarchical default


def test_link_bytes_are_per_step_where_a_call_runs_three_steps(link):
    # benchmarks/results/link-2026-11-26-125333.md's bytes a call (the 10.26M MLP, 1 rank per node): ZeRO-2's call
    # runs three steps (_overlapped_steps), and the line gave it as 6.01 x DDP's 1.01; a step is 2.00 x (two
    # all-reduces), the flat pair's 1.50 x (gloo's reduce-scatter sends what an all-reduce does)
    per_call = {"forward": 0, "allreduce": 41_100_000, "lockstep": 41_400_000, "lockstep_overlap": 123_600_000,
                "lockstep_zero2": 246_800_000, "lockstep_zero2_flat": 185_100_000}
    res = {"nbytes": 41_049_640, "lockstep_hierarchical": False, "link_nbytes_per_step": link.per_step(per_call)}
    line = link._link_bytes_line(res)
    assert line.startswith("Bytes node 0 sent over the link in one step (x the gradients' 41.0 MB;"), line
    assert line.endswith("allreduce 41.1 MB (1.00 x), lockstep 41.4 MB (1.01 x), lockstep_overlap 41.2 MB (1.00 x), "
                         "lockstep_zero2 82.3 MB (2.00 x), lockstep_zero2_flat 61.7 MB (1.50 x)."), line
    assert set(link.STEPS_PER_CALL) == {"lockstep_overlap", *link.ZERO2}  # the entries _runner times three steps a call


def test_the_fp16_limits_use_the_measured_fp16_all_reduce_where_it_ran(link):
    # gloo sums fp16 on the CPU: at 1 Gbit/s the MLP's 20.5 MB fp16 all-reduce is longer than half the fp32 one
    table = link.link_table({**BLOCKS, "allreduce_fp16": [190.0, 209.0]})
    assert table["measured_ms"]["allreduce_fp16"] == pytest.approx(199.5)
    assert table["limits_ms"]["ddp_fp16"] == pytest.approx((42 + 190 + 46.2 + 209) / 2)
    assert table["limits_ms"]["wire_fp16"] == pytest.approx((190 + 209) / 2)
    assert table["limits_ms"]["ddp"] == pytest.approx((387.0 + 425.7) / 2)  # the fp32 limits unchanged
    text = "\n".join(link.markdown_section("t", table))
    assert "the fp16 all-reduce 199.5 ms, 0.55 x the fp32 one" in text, text


@pytest.fixture(scope="module")
def wire_account(link):
    import wire_account as module  # link.py imported it from benchmarks/
    return module


def test_the_wire_account_splits_the_idle_time_by_phase(wire_account):
    # 1 Gbit/s, a sample each ms: 125 kB per ms while busy. Busy from 10 to 50 ms; a 300-byte heartbeat at 55 ms
    # is idle (< 5% of the rate); phases forward 0-10, backward 10-60, optimizer step 60-65.
    samples, sent = [], 0
    for ms in range(0, 66):
        samples.append((ms / 1e3, sent))
        sent += 125_000 if 10 <= ms < 50 else (300 if ms == 55 else 0)
    phases = [("forward", 0.0, 0.010), ("backward", 0.010, 0.060), ("optimizer step", 0.060, 0.065)]
    acc = wire_account.account(samples, 1e9, phases)
    assert acc["step_ms"] == pytest.approx(65.0)
    assert acc["idle_ms"] == pytest.approx(25.0)
    assert acc["idle_by_phase_ms"] == pytest.approx({"forward": 10.0, "backward": 10.0, "optimizer step": 5.0})
    assert [tuple(round(v, 6) for v in s) for s in acc["stretches_ms"]] == [(0.0, 10.0), (50.0, 15.0)]
    row = wire_account.markdown({"torch": acc})[-1]
    assert row == "| torch | 65.0 | 25.0 | 10 / 10 / 5 | 0+10, 50+15 |", row


def test_the_wire_sampler_reads_the_counter_until_stopped(wire_account, tmp_path):
    counter = tmp_path / "tx_bytes"
    counter.write_text("100\n")
    sampler = wire_account.WireSampler(counter, sample_s=0.001).start()
    import time
    time.sleep(0.02)
    (tmp_path / "next").write_text("5000\n")
    os.replace(tmp_path / "next", counter)  # whole, as sysfs gives it
    time.sleep(0.02)
    samples = sampler.stop()
    assert samples[0][1] == 100 and samples[-1][1] == 5000 and len(samples) > 5
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(samples))


def test_the_plan_predicts_a_tuned_contender_with_the_cap_its_trials_chose(link):
    from lockstep.perf.plan import PlanConfig, step_time_s

    table = link.link_table(BLOCKS, nbytes=41.0e6, world_size=2, chosen_mb={"lockstep": 1.0})
    m, rows = table["measured_ms"], table["contenders"]
    cfg = PlanConfig(params=41.0e6 / 4, precision="fp32", world_size=2, compute_ms=m["compute"], bucket_cap_mb=1.0)
    assert rows["lockstep"]["plan_ms"] == pytest.approx(step_time_s(cfg, m["allreduce"] / 1e3)[1] * 1e3)
    assert rows["lockstep"]["plan_ms"] != rows["torch"]["plan_ms"]  # torch's 25 MB buckets
    one = link.link_table(BLOCKS, nbytes=41.0e6, world_size=2, chosen_mb={"lockstep": None})["contenders"]
    one_cfg = PlanConfig(params=41.0e6 / 4, precision="fp32", world_size=2, compute_ms=m["compute"],
                         bucket_cap_mb=link.ONE_BUCKET_MB)
    assert one["lockstep"]["plan_ms"] == pytest.approx(step_time_s(one_cfg, m["allreduce"] / 1e3)[1] * 1e3)
