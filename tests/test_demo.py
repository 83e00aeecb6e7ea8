"""``lockstep demo`` end to end: the real command, 2 real CPU ranks, fewer epochs and a lower bar."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lockstep.train.checkpoint import list_checkpoints, load_checkpoint
from lockstep.train.demo import cli_main
from lockstep.train.metrics import read_metrics

EPOCHS = 3


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run([sys.executable, "-m", "lockstep", "demo", "--epochs", str(EPOCHS), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    return out, proc


def test_demo_trains_and_reports(demo_run):
    out, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"test accuracy (\d\.\d\d)", lines[-1])
    assert match, f"last line is {lines[-1]!r}"
    assert float(match.group(1)) >= 0.85  # 3 epochs; the default 12 reach >= 0.95
    epoch_lines = [line for line in lines if re.search(r"epoch +\d+ +train loss", line)]
    assert len(epoch_lines) == EPOCHS
    losses = [float(re.search(r"train loss (\S+)", line).group(1)) for line in epoch_lines]
    assert losses[-1] < losses[0]
    assert re.search(r"share of step time spent in communication: \d+\.\d%", proc.stdout)
    assert re.search(r"\d+ samples/s", proc.stdout)


def test_demo_writes_metrics_checkpoint_and_plot(demo_run):
    out, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(out / "metrics.jsonl")
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(EPOCHS))
    assert all(r["eval_samples"] == 359 for r in epochs)  # the whole test split, each image once
    train = [r for r in records if r["event"] == "train"]
    assert train and all(0.0 <= r["comm_share"] <= 1.0 for r in train)  # from ddp.comm_stats(), every logged step
    (step, path), = list_checkpoints(out)  # keep_last=1: only the final one
    payload = load_checkpoint(path)
    assert payload["step"] == step and payload["world_size"] == 2
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_arguments(capsys):
    assert cli_main(["--nproc", "0"]) == 2
    assert "--nproc must be >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["--lr", "-1"]) == 2
    assert "--lr must be > 0" in capsys.readouterr().err


def test_a_second_run_into_the_same_folder_stops_before_training(demo_run):
    # issue 28, item 1: `lockstep demo --epochs 1 --out runs/d` after a 2-epoch run there deleted its own
    # checkpoint and kept the old run's (pruning by step across runs), with nothing said
    out, first = demo_run
    assert first.returncode == 0, first.stderr
    before = [(step, path.read_bytes()) for step, path in list_checkpoints(out)]
    proc = subprocess.run([sys.executable, "-m", "lockstep", "demo", "--epochs", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr  # no rank was started
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"lockstep demo: {out} holds checkpoints of another run")
    assert f"ckpt-{before[-1][0]:09d}.pt" in line
    assert "--resume" in line and "a new --out" in line and "--overwrite" in line
    assert [(step, path.read_bytes()) for step, path in list_checkpoints(out)] == before  # untouched
