"""`lockstep bench scaling` run small (a tiny MLP, 3 steps, 1 and 2 real gloo ranks): its outputs' structure and arithmetic."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from lockstep.costmodel import LINKS
from lockstep.perf.plan import PlanConfig, make_plan
from lockstep.perf.scaling import add_efficiency_and_prediction, build_model, cli_main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    too_many = (os.cpu_count() or 1) + 1  # never run: it would oversubscribe the cores
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli_main(["--model", "models:MLP", "--nproc", f"1,2,{too_many}", "--mode", "both", "--batch", "8",
                         "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    [json_path] = out.glob("scaling_models_MLP_*.json")
    return json.loads(json_path.read_text()), json_path, too_many, printed.getvalue()


def test_one_rank_is_measured_once_for_both_modes(run):
    # At N=1 strong (B / 1 per rank) and weak (B per rank) are the same run: one measurement, used twice
    # (two measurements of it differed by 58% once, 11.07 vs 17.47 ms, which made the efficiencies disagree).
    data, path, _, printed = run
    rows = {(r["mode"], r["world_size"]): r for r in data["rows"]}
    strong, weak = rows["strong", 1], rows["weak", 1]
    assert weak["step_s_all"] == strong["step_s_all"] and weak["step_s"] == strong["step_s"]
    assert weak["measured_as"] == strong["measured_as"] == "strong" and "measured_as" not in rows["weak", 2]
    assert "N=1 is measured once and used for every mode" in path.with_suffix(".md").read_text()
    assert printed.splitlines()[0] == f"lockstep bench scaling: results go to {path.parent.resolve()} (--out DIR to change)"


def test_rows_cover_every_mode_and_world_size(run):
    data, path, too_many, _ = run
    rows = data["rows"]
    assert [(r["mode"], r["world_size"], r["batch_per_rank"]) for r in rows] == [
        ("strong", 1, 8), ("strong", 2, 4), ("weak", 1, 8), ("weak", 2, 8)]
    assert all(len(r["step_s_all"]) == 3 and r["step_s"] > 0 and r["params"] == 6922 for r in rows)
    assert data["meta"]["skipped"] and data["meta"]["skipped"][0].startswith(f"N={too_many}: {too_many} ranks x 1 thread(s)")
    assert "time-share cores" in data["meta"]["skipped"][0]
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    table = path.with_suffix(".md").read_text()
    assert "| strong | 2 | 4 |" in table and f"not run: N={too_many}" in table


def test_efficiencies_and_prediction_arithmetic(run):
    rows = {(r["mode"], r["world_size"]): r for r in run[0]["rows"]}
    for mode in ("strong", "weak"):
        t1, t2 = rows[mode, 1]["step_s"], rows[mode, 2]["step_s"]
        # One rank's "all-reduce" is still a hand-off to gloo's thread: on a sub-millisecond step its wait can be a
        # large share (0.49 seen once in 3), so only its range is asserted, not a timing.
        assert rows[mode, 1]["efficiency"] == 1.0 and 0 <= rows[mode, 1]["comm_share"] < 1
        expected = t1 / (2 * t2) if mode == "strong" else t1 / t2
        assert rows[mode, 2]["efficiency"] == pytest.approx(expected)
        assert rows[mode, 2]["samples_per_s"] == pytest.approx(rows[mode, 2]["global_batch"] / t2)
        # The share of a rank's own step time spent waiting (its waits lie inside its steps, so it is below 1 by
        # construction; against the paced median step it once read 1.22).
        assert rows[mode, 2]["comm_share"] == pytest.approx(rows[mode, 2]["comm_wait_s_per_step"] / rows[mode, 2]["rank_step_s_mean"])
        assert 0 <= rows[mode, 2]["comm_share"] < 1
        assert rows[mode, 2]["predicted_step_s"] > 0 and 0 < rows[mode, 2]["predicted_efficiency"] <= 1.0


def test_prediction_is_the_plans():
    rows = [{"mode": "strong", "world_size": n, "batch_per_rank": 32 // n, "global_batch": 32, "step_s": s,
             "comm_wait_s_per_step": c, "params": 10_000_000} for n, s, c in ((1, 0.100, 0.0), (2, 0.080, 0.02))]
    add_efficiency_and_prediction(rows, LINKS["10gbe"])
    plan = make_plan(PlanConfig(params=1e7, precision="fp32", optimizer="sgd-nomomentum", world_size=2, link=LINKS["10gbe"],
                                compute_ms=50.0, device_memory_gb=1e6))
    assert rows[1]["predicted_step_s"] == pytest.approx(plan.step_ms["overlap"] / 1e3)
    assert rows[1]["efficiency"] == pytest.approx(0.100 / (2 * 0.080)) and rows[1]["comm_share"] == pytest.approx(0.25)
    assert rows[1]["predicted_efficiency"] == pytest.approx(0.100 / (2 * rows[1]["predicted_step_s"]))


def test_a_model_whose_inputs_cannot_be_inferred_is_refused():
    with pytest.raises(ValueError, match="make_batch"):
        build_model("models:CNN")
    model, make_batch = build_model("cnn")
    import torch

    x, y = make_batch(2, torch.Generator().manual_seed(0))
    assert model(x).shape == (2, 10) and y.shape == (2,)
