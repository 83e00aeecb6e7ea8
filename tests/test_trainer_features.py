"""What Lightning and Accelerate users expect of a Trainer (issue 28, item 11), on 2 real gloo ranks:
fp16 with a GradScaler (skips on Inf, scale updates, exact resume of the scaler), a metric function,
a CSV log always and TensorBoard's when installed. One spawned group runs every scenario."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import time

import pytest
import torch
from dist_utils import run_ranks
from test_trainer import N_EVAL, Crash, _data, _equal, _model, _params
from torch import nn

INF_AT_STEP = 5  # rank 1's loss is Inf in this optimizer step: every rank's averaged gradient is then Inf


def _fp16_train(directory, crash_at=None, resume=False, **overrides):
    from lockstep import Trainer, TrainerConfig

    model = _model(11, dropout=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    holder, seen = {}, []

    def loss_fn(outputs, targets):  # Inf on rank 1 in one step (the step counter: the same in a resumed run)
        loss = nn.functional.cross_entropy(outputs, targets)
        trainer = holder.get("t")
        if trainer is not None and trainer.ddp.training and trainer.step + 1 == INF_AT_STEP \
                and torch.distributed.get_rank() == 1:
            loss = loss * float("inf")
        return loss

    def on_step_end(trainer):
        seen.append((trainer.step, trainer.precision.scaler.get_scale(), _params(trainer.model)))
        if trainer.step == crash_at:
            raise Crash(f"simulated crash after step {crash_at}")

    settings = dict(epochs=2, batch_size=8, seed=5, checkpoint_dir=directory, save_every_steps=3, keep_last=2,
                    progress=False, resume=resume, autocast_dtype="float16", grad_clip_norm=5.0)
    settings.update(overrides)
    trainer = Trainer(model, optimizer, loss_fn, _data(96, 3), None, TrainerConfig(**settings), scaler=scaler,
                      on_step_end=on_step_end)
    holder["t"] = trainer
    try:
        trainer.fit()
    except Crash:
        pass
    return trainer, seen


def _scenarios(rank, world_size, root):
    from lockstep import Trainer, TrainerConfig

    out = {}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = f"error: {type(e).__name__}: {e}"

    # 1. fp16 + GradScaler: the Inf step is skipped on every rank, the scale halves, then grows every 3 steps
    def fp16():
        trainer, seen = _fp16_train(os.path.join(root, "fp16_a"))
        before = {s: p for s, _, p in seen}
        return {"scales": [(s, scale) for s, scale, _ in seen],
                "skipped_unchanged": _equal(before[INF_AT_STEP - 1], before[INF_AT_STEP]),
                "step_after_moved": not _equal(before[INF_AT_STEP], before[INF_AT_STEP + 1]),
                "skipped": trainer.precision.skipped_steps, "params": _params(trainer.model),
                "scaler": trainer.precision.state_dict(), "nonfinite_check": trainer.ddp.detect_nonfinite}
    attempt("fp16", fp16)

    # 2. crash after step 7 (checkpoint at 6, after the skip), resume: the same parameters and scaler state
    def fp16_resume():
        d = os.path.join(root, "fp16_b")
        _fp16_train(d, crash_at=7)
        trainer, _ = _fp16_train(d, resume=True)
        return {"params": _params(trainer.model), "scaler": trainer.precision.state_dict(),
                "resumed_from": str(trainer.resumed_from)}
    attempt("fp16_resume", fp16_resume)

    # 3. a metric function: top-2 accuracy and mean max-probability, exact over the eval set
    def metric():
        def top2(outputs, targets):
            hit = (outputs.topk(2, dim=1).indices == targets[:, None]).any(dim=1).float().mean()
            return {"top2": hit.item(), "confidence": outputs.softmax(1).max(1).values.mean().item()}

        model = _model(12, dropout=0.0)
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, _data(64, 2),
                    _data(N_EVAL, 1), TrainerConfig(epochs=1, batch_size=8, eval_batch_size=5, progress=True),
                    metric_fn=top2)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # the bar and the epoch's line (rank 0)
            record = t.fit()["history"][-1]
        x, y = _data(N_EVAL, 1).tensors
        with torch.no_grad():
            logits = model(x)
        ref = top2(logits, y)
        return {"record": record, "ref": ref, "printed": printed.getvalue()}
    attempt("metric", metric)

    # 4. per-run logs: metrics.csv always, TensorBoard event files (tensorboard is installed here)
    def logs():
        d = os.path.join(root, "logs_run")
        model = _model(13, dropout=0.0)
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, _data(64, 2),
                    _data(N_EVAL, 1), TrainerConfig(epochs=2, batch_size=8, progress=False, log_every_steps=1,
                                                    metrics_path=os.path.join(d, "metrics.jsonl")))
        t.fit()
        return {"run_id": t.run_id}
    attempt("logs", logs)

    # 5. rank 1 sleeps 10 ms per sample in its data loading: the epoch's straggler line names it and the cause
    def straggler():
        class SlowOnRank1(torch.utils.data.Dataset):
            def __init__(self, data):
                self.data = data

            def __len__(self):
                return len(self.data)

            def __getitem__(self, i):
                if rank == 1:
                    time.sleep(0.01)
                return self.data[i]

        model = _model(14, dropout=0.0)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # the bar and the straggler line go to stdout (rank 0)
            t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                        # 8 steps: the first two wait inside forward (DDP's start-up collectives), and the line
                        # needs the wait to stand out of the step-to-step noise (stragglers.py; 4 steps did not)
                        SlowOnRank1(_data(128, 2)), None, TrainerConfig(epochs=1, batch_size=8, progress=True))
            record = t.fit()["history"][-1]
        return {"record": record, "printed": printed.getvalue()}
    attempt("straggler", straggler)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer_features"))
    return root, run_ranks(_scenarios, world_size=2, args=(root,), timeout_s=240)


def test_fp16_grad_scaler_skips_the_inf_step_and_updates_the_scale(results):
    _, out = results
    for rank in range(2):
        r = out[rank]["fp16"]
        assert not isinstance(r, str), r
        scales = dict(r["scales"])
        # 1024 for steps 1-3, doubled after 3 good steps (2048 at 3, 4), halved by the Inf step 5 (1024),
        # doubled again 3 good steps later
        assert [scales[s] for s in (1, 2, 3, 4, 5, 6, 7, 8)] == [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048]
        assert r["skipped_unchanged"] and r["step_after_moved"] and r["skipped"] == 1
        assert r["nonfinite_check"] is False  # the scaler handles Inf: DDP's check would raise on it
    assert _equal(out[0]["fp16"]["params"], out[1]["fp16"]["params"])


def test_fp16_resume_restores_the_scaler_exactly(results):
    _, out = results
    for rank in range(2):
        r = out[rank]["fp16_resume"]
        assert not isinstance(r, str), r
        assert r["resumed_from"].endswith("ckpt-000000006.pt")
        assert _equal(r["params"], out[rank]["fp16"]["params"]), f"rank {rank} diverged after the resume"
        assert r["scaler"] == out[rank]["fp16"]["scaler"]


def test_metric_function_is_averaged_exactly_over_the_eval_set(results):
    _, out = results
    for rank in range(2):
        r = out[rank]["metric"]
        assert not isinstance(r, str), r
        # the reference is one batch of all 37 samples; the Trainer's is 2 ranks x batches of 5, weighted
        assert r["record"]["eval_top2"] == pytest.approx(r["ref"]["top2"], rel=1e-6)  # float32 batch means
        assert r["record"]["eval_confidence"] == pytest.approx(r["ref"]["confidence"], rel=1e-6)
        assert r["record"]["eval_samples"] == N_EVAL


def test_rank_0_prints_the_epochs_eval_loss_and_metrics(results):
    # issue 34, item 6: the Trainer printed no eval numbers (the bar has the training ones, and a terminal clears it)
    _, out = results
    r = out[0]["metric"]
    assert not isinstance(r, str), r
    record, line = r["record"], r["printed"].splitlines()[-1]
    assert line == (f"epoch  1  train loss {record['train_loss']:.4f}  eval loss {record['eval_loss']:.4f}  "
                    f"eval accuracy {record['eval_accuracy']:.4f}  eval confidence {record['eval_confidence']:.4f}  "
                    f"eval top2 {record['eval_top2']:.4f}  samples/s {record['samples_per_s']:.0f}"), line
    assert out[1]["metric"]["printed"] == ""  # rank 0 alone prints


def test_straggler_line_names_the_rank_that_sleeps_in_its_data_loading(results):
    # issue 28, item 9: `comm` was rank 0's view only, and nothing named the slow rank
    _, out = results
    for rank in range(2):
        r = out[rank]["straggler"]
        assert not isinstance(r, str), r
        found = r["record"]["straggler"]
        assert found["rank"] == 1 and found["cause"] == "data loading" and found["wait_share"] > 0.1, found
    lines = [line for line in out[0]["straggler"]["printed"].splitlines() if "straggler" in line]
    assert len(lines) == 1 and lines[0].startswith("epoch 1: straggler rank 1 made the others wait "), lines
    assert "its time went to data loading" in lines[0]
    assert out[1]["straggler"]["printed"] == ""  # rank 0 alone prints


def test_csv_log_always_and_tensorboard_when_installed(results):
    root, out = results
    r = out[0]["logs"]
    assert not isinstance(r, str), r
    folder = os.path.join(root, "logs_run", "logs", r["run_id"])
    with open(os.path.join(folder, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    train = [row for row in rows if row["event"] == "train" and row["name"] == "loss"]
    assert [int(row["step"]) for row in train] == list(range(1, 9))  # 64 samples / (2 ranks x 8) x 2 epochs
    evals = [row for row in rows if row["event"] == "epoch" and row["name"] == "eval_loss"]
    assert [int(row["epoch"]) for row in evals] == [1, 2]
    events = [name for name in os.listdir(folder) if name.startswith("events.out.tfevents")]
    pytest.importorskip("tensorboard")
    assert events, os.listdir(folder)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"] and "epoch/eval_loss" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 9))
