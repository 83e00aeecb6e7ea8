"""``lockstep demo`` end to end: the real command, 2 real CPU ranks, fewer epochs and a lower bar."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lockstep.train.checkpoint import list_checkpoints, load_checkpoint, verify
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
    # issue 28, item 8: the bar and the summary in one stream, in order, epochs counted alike from 1, and
    # the bar's last line carrying the summary's numbers (the epoch's all-rank loss, this epoch's samples/s)
    assert not re.search(r"epoch \d+: \d+/\d+ steps", proc.stderr), proc.stderr
    for k, summary in enumerate(epoch_lines, start=1):
        at = lines.index(summary)
        bars = [line for line in lines[:at] if re.search(rf"epoch {k}: 23/23 steps", line)]
        assert bars, f"no bar line for epoch {k} before its summary {summary!r}"
        assert re.search(r"train_loss=(\S+?),", bars[-1]).group(1) == re.search(r"train loss (\S+)", summary).group(1)
        assert re.search(r"samples_per_s=(\d+)", bars[-1]).group(1) == re.search(r"samples/s (\d+)", summary).group(1)
    assert not any(re.search(r"epoch 0\b", line) for line in lines)
    assert re.search(r"\d+ samples/s", proc.stdout)


def test_demo_writes_metrics_checkpoint_and_plot(demo_run):
    out, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(out / "metrics.jsonl")
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1))  # 1-based, as printed
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


def _demo(*args, env=None, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "lockstep", "demo", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def test_ctrl_c_is_one_line_exit_130_the_checkpoint_intact_and_resume_continues_without_matplotlib(tmp_path):
    # issue 28, item 6: Ctrl-C printed SignalException / KeyboardInterrupt tracebacks; matplotlib missing
    # crashed in plot_curves after training, with no accuracy line
    out = tmp_path / "run"
    # Ctrl-C reaches the whole foreground process group: the demo, its agent and the ranks
    proc = _demo("--epochs", 40, "--out", out, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list_checkpoints(out) or verify(list_checkpoints(out)[-1][1]) is not None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "death signal", "Closing process"):
        assert noise not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("lockstep demo: stopped by SIGINT; the last checkpoint ") and "--resume" in last, last
    (step, path), = list_checkpoints(out)
    # issue 34, item 5: the hint is a command to paste; without --epochs it trains to the interrupted run's 40
    assert last.endswith(f"ckpt-{step:09d}.pt is intact; continue with: lockstep demo --resume --out {out}")
    assert verify(path) is None and load_checkpoint(path)["target_epochs"] == 40
    interrupted = load_checkpoint(path)["run_id"]
    # resume it with matplotlib unimportable: a note up front, training, the accuracy line last, no plot
    blocked = tmp_path / "no_matplotlib" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib' (blocked by the test)\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", "")]))
    epochs = step // 23 + 1  # one more epoch than the checkpoint holds
    resumed = _demo("--epochs", epochs, "--out", out, "--resume", env=env)
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stdout + stderr
    assert f"[rank0]: lockstep: resumed from step {step} (epoch {step // 23} of {epochs} finished) out of {path}\n" \
        in stdout, stdout
    assert "matplotlib is not installed, so no curves.png" in stderr and "Traceback" not in stderr
    assert re.fullmatch(r"test accuracy \d\.\d\d", stdout.strip().splitlines()[-1])
    assert not (out / "curves.png").exists()
    (new_step, new_path), = list_checkpoints(out)
    assert new_step == step + 23 and load_checkpoint(new_path)["run_id"] == interrupted  # the same run, continued
    runs = {r.get("run") for r in read_metrics(out / "metrics.jsonl")}
    assert runs == {interrupted}
    # issue 34, item 5: resumed once more, with nothing left: said at once, exit 0, no rank started, no
    # "0 samples/s"; the target is the last run's (--epochs above), not the default 12
    again = subprocess.run([sys.executable, "-m", "lockstep", "demo", "--resume", "--out", str(out)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr == "", again.stdout + again.stderr
    assert again.stdout.splitlines() == [
        f"lockstep demo: nothing to train: the checkpoint {new_path} finished epoch {epochs} of {epochs}; "
        f"to train 2 more: lockstep demo --resume --out {out} --epochs {epochs + 2}"]


def test_read_only_out_is_one_line_before_any_rank_starts(tmp_path):
    # issue 28, item 6: an OSError traceback from mkdir
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)]).returncode != 0:
            pytest.skip("root without mount: no way to make a folder read-only")
    else:
        target.chmod(0o555)
    try:
        proc = _demo("--out", target / "run")
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(target)])
    assert proc.returncode == 2, stdout + stderr
    assert stderr.strip().splitlines() == [f"lockstep demo: --out {target / 'run'} is not writable: "
                                           + ("Read-only file system" if os.geteuid() == 0 else "Permission denied")]
    assert stdout == ""


def _fake_checkpoint(directory, epoch: int, target_epochs: int | None):
    from lockstep.train.checkpoint import checkpoint_path, save_atomic

    payload = {"format": "lockstep-trainer-v1", "step": 23 * epoch, "epoch": epoch, "batches_done": 0}
    if target_epochs is not None:
        payload["target_epochs"] = target_epochs
    return save_atomic(payload, checkpoint_path(directory, 23 * epoch))


def test_resume_without_epochs_trains_to_the_interrupted_runs_target(tmp_path):
    # issue 34, item 5: `--resume --out DIR` (the Ctrl-C hint) of a 40-epoch run stopped at epoch 13 ended at
    # once with "0 samples/s": the default 12 epochs were already done
    from lockstep.train.demo import _continue_command, _epochs_to_train, _parse

    path = _fake_checkpoint(tmp_path, epoch=13, target_epochs=40)
    assert _epochs_to_train(_parse(["--resume", "--out", str(tmp_path)]), tmp_path) == (40, None)
    assert _epochs_to_train(_parse(["--resume", "--out", str(tmp_path), "--epochs", "20"]), tmp_path) == (20, None)
    epochs, line = _epochs_to_train(_parse(["--resume", "--out", str(tmp_path), "--epochs", "13", "--seed", "4"]),
                                    tmp_path)
    assert epochs == 13 and line == (f"lockstep demo: nothing to train: the checkpoint {path} finished epoch 13 of "
                                     f"13; to train 2 more: lockstep demo --resume --out {tmp_path} --seed 4 "
                                     f"--epochs 15")
    assert _epochs_to_train(_parse(["--out", str(tmp_path)]), tmp_path) == (12, None)  # not resuming: the default
    older = tmp_path / "older"  # a checkpoint from before the target was kept: the default, 12
    _fake_checkpoint(older, epoch=5, target_epochs=None)
    assert _epochs_to_train(_parse(["--resume", "--out", str(older)]), older) == (12, None)
    ns = _parse(["--nproc", "3", "--batch-size", "16", "--lr", "0.1", "--epochs", "40", "--out", "runs/x"])
    assert _continue_command(ns, tmp_path) == f"lockstep demo --resume --out {tmp_path} --nproc 3 --batch-size 16"


def test_curves_have_whole_epoch_ticks_on_a_short_run():
    # issue 34, item 6: a 2-epoch run's curves.png had epoch ticks at 1.0, 1.2, 1.4, ...
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lockstep.train.demo import draw_curves

    record = {"train_loss": 1.0, "eval_loss": 0.9, "eval_accuracy": 0.5}
    fig = draw_curves({1: record, 2: {**record, "train_loss": 0.5}})
    try:
        fig.canvas.draw()
        for ax in fig.axes:
            low, high = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if low <= t <= high]
            assert ticks == [1.0, 2.0], ticks
    finally:
        plt.close(fig)


def test_the_demos_digits_are_scikit_learns_read_without_importing_it():
    """The demo's data set is scikit-learn's bundled digits, value for value, and a rank that loads it does not
    import scikit-learn (about 1 CPU-s per rank per run, more than the table's read)."""
    import numpy as np
    from sklearn.datasets import load_digits

    from lockstep.train.data import digits_arrays

    pixels, labels = digits_arrays()
    reference = load_digits()
    assert pixels.shape == (1797, 64) and np.array_equal(pixels, reference.data)
    assert labels.dtype == np.int64 and np.array_equal(labels, reference.target)
    probe = ("import sys; from lockstep.train.data import digits_datasets; train, test = digits_datasets(); "
             "print(len(train) + len(test), 'sklearn' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["1797", "False"], proc.stdout + proc.stderr
