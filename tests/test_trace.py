"""The overlap timeline on 2 real gloo ranks: a plain script, the Trainer and LOCKSTEP_TRACE, in one spawned group.

Checks the Chrome trace's structure (every rank, every phase, each bucket's all-reduce after its ready
instant and inside the step), the shared clock, the summary's arithmetic and the PNG; and, in-process,
the summary of a hand-made timeline to the microsecond.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from lockstep import DistributedDataParallel as DDP
from lockstep.diagnostics.timeline import format_summary, step_breakdown, summarise
from lockstep.costmodel import LINKS, allreduce_time_s


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def _read(directory: Path) -> dict:
    out = {}
    for name in ("trace.json", "summary.json"):
        path = directory / name
        out[name] = json.loads(path.read_text()) if path.exists() else None
    png = directory / "timeline.png"
    out["png"] = png.read_bytes()[:8] if png.exists() else None
    return out


def _case(rank, world_size, root):
    root = Path(root)
    out = {}
    # 1. A plain script: DDP(trace_dir=...), steps 2..3, a 5 ms "optimizer + data" gap between steps.
    ddp = DDP(_model(), trace_dir=root / "plain", trace_steps=(2, 3), bucket_cap_mb_list=[0.01, 0.1])  # 3 buckets: [b2, w2, b1], [w1], [b0, w0]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        opt.zero_grad()
        F.cross_entropy(ddp(torch.randn(32, 64, generator=g)), torch.randint(0, 10, (32,), generator=g)).backward()
        opt.step()
        time.sleep(0.005)
    out["plain_finished"] = ddp.trace.finished
    # the recorder detached itself: what stays is the hang watchdog's progress observer (always on)
    out["plain_observer_after"] = type(ddp.reducer.observer).__name__
    out["plain_offset_s"] = ddp.trace.offset_s
    out["buckets_nbytes"] = [b.flat.numel() * 4 for b in ddp.reducer.buckets]
    # 2. The Trainer: marks data and optimizer; a run (3 steps) shorter than its window's end is written by fit().
    from lockstep import Trainer, TrainerConfig

    data = torch.utils.data.TensorDataset(torch.randn(48, 64), torch.randint(0, 10, (48,)))
    trainer = Trainer(_model(), None or torch.optim.SGD(_model().parameters(), lr=0.01), F.cross_entropy, data,
                      config=TrainerConfig(batch_size=8, progress=False, trace_dir=str(root / "trainer"), trace_steps=(2, 5)))
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.01)
    trainer.fit()
    out["trainer_finished"] = trainer.ddp.trace.finished
    # 3. LOCKSTEP_TRACE=DIR with LOCKSTEP_TRACE_STEPS.
    os.environ.update(LOCKSTEP_TRACE=str(root / "env"), LOCKSTEP_TRACE_STEPS="1:1")
    try:
        ddp = DDP(_model())
    finally:
        del os.environ["LOCKSTEP_TRACE"], os.environ["LOCKSTEP_TRACE_STEPS"]
    for _ in range(2):
        F.cross_entropy(ddp(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
    out["env_finished"] = ddp.trace.finished
    # 4. The fp16 hook, run by the reducer itself (ddp.fused_compress): its buckets send half the bytes.
    from lockstep.comm_hooks import fp16_compress_hook

    ddp = DDP(_model(), trace_dir=root / "fp16", trace_steps=(2, 2), bucket_cap_mb_list=[0.01, 0.1])
    ddp.register_comm_hook(None, fp16_compress_hook)
    for _ in range(3):
        F.cross_entropy(ddp(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
    out["fp16_nbytes"] = [b.flat.numel() * 2 for b in ddp.reducer.buckets]
    if rank == 0:
        out["files"] = {name: _read(root / name) for name in ("plain", "trainer", "env", "fp16")}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_case, 2, args=(str(tmp_path_factory.mktemp("trace")),), timeout_s=240)


def _spans(trace, pid, name, step=None):
    return [e for e in trace["traceEvents"] if e.get("pid") == pid and e["name"] == name and e["ph"] in ("X", "i")
            and (step is None or e["args"]["step"] == step)]


def test_plain_script_trace_has_every_phase_on_every_rank(results):
    trace = results[0]["files"]["plain"]["trace.json"]
    nbuckets = len(results[0]["buckets_nbytes"])
    assert nbuckets >= 3
    names = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "process_name"), (1, "process_name")}
    for pid in (0, 1):
        for step in (2, 3):
            [fwd], [bwd], [wait] = (_spans(trace, pid, n, step) for n in ("forward", "backward", "end-of-backward wait"))
            assert fwd["ts"] + fwd["dur"] <= bwd["ts"] and bwd["ts"] + bwd["dur"] <= wait["ts"] + 1
            for b in range(nbuckets):
                [ready], [comm] = _spans(trace, pid, f"bucket {b} ready", step), _spans(trace, pid, f"all-reduce bucket {b}", step)
                assert bwd["ts"] <= ready["ts"] <= comm["ts"] <= comm["ts"] + comm["dur"] <= wait["ts"] + wait["dur"] + 1
                assert comm["args"]["nbytes"] == results[0]["buckets_nbytes"][b] and comm["tid"] == 10 + b
        gaps = _spans(trace, pid, "optimizer + data")
        assert [g["args"]["step"] for g in gaps] == [2, 3] and all(g["dur"] >= 5000 for g in gaps)  # the 5 ms sleep
        assert not _spans(trace, pid, "forward", 1) and not _spans(trace, pid, "forward", 4)  # only the window
    assert all(r["plain_finished"] and r["plain_observer_after"] == "ProgressObserver" for r in results)


def test_ranks_share_one_clock(results):
    for r in results:
        assert abs(r["plain_offset_s"]) < 0.05  # one host: perf_counter is one clock; the ping finds ~0
    trace = results[0]["files"]["plain"]["trace.json"]
    [f0], [f1] = _spans(trace, 0, "forward", 3), _spans(trace, 1, "forward", 3)
    assert abs(f0["ts"] - f1["ts"]) < 0.1e6  # the ranks start step 3 together (they all-reduced just before)


def test_summary_numbers_add_up(results):
    files = results[0]["files"]["plain"]
    summary = files["summary.json"]
    assert files["png"] == b"\x89PNG\r\n\x1a\n"
    assert [r["rank"] for r in summary["ranks"]] == [0, 1] and summary["world_size"] == 2
    for r in summary["ranks"] + [summary["overall"]]:
        assert 0 < r["compute_s"] < r["step_s"] and 0 < r["comm_s"] and 0 <= r["exposed_comm_s"] <= r["step_s"]
        assert r["host_s"] >= 0.005
        assert r["overlap_share"] == pytest.approx(1 - r["exposed_comm_s"] / r["comm_s"])
    assert [b["nbytes"] for b in summary["buckets"]] == results[0]["buckets_nbytes"]
    for b in summary["buckets"]:
        assert b["samples"] == 4  # 2 steps x 2 ranks
        assert b["predicted_s"] == allreduce_time_s(b["nbytes"], 2, LINKS["loopback"], "ring")
        assert b["algbw_gb_s"] == pytest.approx(b["nbytes"] / b["allreduce_s"] / 1e9)
    text = format_summary(summary)
    assert "exposed ms" in text and "predicted ms (loopback ring" in text and len(text.splitlines()) == 4 + 2 + len(summary["buckets"])


def test_trainer_marks_data_and_optimizer(results):
    trace = results[0]["files"]["trainer"]["trace.json"]
    assert all(r["trainer_finished"] for r in results)
    for pid in (0, 1):
        assert [e["args"]["step"] for e in _spans(trace, pid, "optimizer")] == [2, 3]
        assert {e["args"]["step"] for e in _spans(trace, pid, "data")} == {2}  # data of step 3, in step 2's period
        assert not _spans(trace, pid, "optimizer + data")  # the Trainer's marks replace the plain-script gap
        assert [e["args"]["step"] for e in _spans(trace, pid, "forward")] == [2, 3]
    assert results[0]["files"]["trainer"]["summary.json"]["ranks"][0]["steps"] == [2, 3]


def test_env_variable_traces(results):
    files = results[0]["files"]["env"]
    assert all(r["env_finished"] for r in results)
    assert [e["args"]["step"] for e in _spans(files["trace.json"], 1, "forward")] == [1]


def test_breakdown_of_a_hand_made_step():
    ms = 1e-3
    ev = lambda name, cat, s, e, step=1, **a: {"name": name, "cat": cat, "step": step, "start": s * ms, "end": e * ms, "args": a}
    events = [
        ev("forward", "compute", 0, 10), ev("backward", "compute", 10, 30),
        ev("all-reduce bucket 0", "comm", 15, 25, bucket=0, nbytes=1000), ev("all-reduce bucket 1", "comm", 20, 36, bucket=1, nbytes=3000),
        ev("end-of-backward wait", "wait", 30, 36), ev("optimizer + data", "host", 37, 40),
        ev("forward", "compute", 40, 50, step=2),
    ]
    step = step_breakdown(events)[1]
    assert step["step_s"] == pytest.approx(40 * ms) and step["compute_s"] == pytest.approx(30 * ms)
    assert step["comm_s"] == pytest.approx(21 * ms)  # the union of [15, 25] and [20, 36]
    assert step["exposed_comm_s"] == pytest.approx(6 * ms) and step["overlap_share"] == pytest.approx(1 - 6 / 21)
    summary = summarise([{"rank": 0, "offset_s": 0.0, "events": events}], 2, "10gbe")
    assert [b["allreduce_s"] for b in summary["buckets"]] == pytest.approx([10 * ms, 16 * ms])
    assert summary["buckets"][1]["predicted_s"] == allreduce_time_s(3000, 2, LINKS["10gbe"])


def test_a_fused_fp16_hook_counts_the_bytes_it_sends(results):
    summary = results[0]["files"]["fp16"]["summary.json"]
    assert [b["nbytes"] for b in summary["buckets"]] == results[0]["fp16_nbytes"]
    assert [b["nbytes"] for b in summary["buckets"]] != results[0]["buckets_nbytes"]  # not the float32 size
