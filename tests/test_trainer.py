"""Trainer on 2 real gloo ranks: exact resume after a crash, exact evaluation, accumulation, lr rules, rank-0 files.

One spawned group runs every scenario (``_scenarios``); the tests assert on what it returned.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys

import pytest
from levels import full_only
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dist_utils import run_ranks
from lockstep import Trainer, TrainerConfig
from lockstep.train.checkpoint import list_checkpoints, load_checkpoint, save_atomic
from lockstep.launch.launcher import launch_function
from lockstep.train.metrics import measure_exposed_comm, read_metrics

N_TRAIN, N_EVAL = 150, 37  # neither divides evenly over 2 ranks x 8: padding and a short last batch


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()  # 3 classes
    return TensorDataset(x, y)


def _model(init_seed: int, dropout: float = 0.2) -> nn.Module:
    # a different seed on each rank: DDP's start-up broadcast must align the parameters, and each
    # rank's RNG (dropout) is then its own, which checkpoints have to keep per rank
    torch.manual_seed(init_seed + 1000 * int(os.environ.get("RANK", "0")))
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 3))


class Crash(Exception):
    pass


def _crash_at(step: int):
    def hook(trainer):
        if trainer.step == step:
            raise Crash(f"simulated crash after step {step}")

    return hook


def _train(directory, init_seed=1, crash_at=None, resume=False, on_step_end=None, device=None, **overrides):
    """Train the standard setup; returns (trainer, summary or None if it crashed)."""
    model = _model(init_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = dict(epochs=3, batch_size=8, grad_accum_steps=2, grad_clip_norm=1.0, warmup_steps=4, seed=3,
                    checkpoint_dir=str(directory), save_every_steps=3, keep_last=2, progress=False,
                    metrics_path=os.path.join(directory, "metrics.jsonl"), log_every_steps=1, resume=resume)
    settings.update(overrides)
    trainer = Trainer(model, optimizer, nn.functional.cross_entropy, _data(N_TRAIN, 0), _data(N_EVAL, 1),
                      TrainerConfig(**settings), on_step_end=_crash_at(crash_at) if crash_at else on_step_end,
                      device=device)
    try:
        return trainer, trainer.fit()
    except Crash:
        return trainer, None


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _audit_writes(directory, log):
    """Record this process's opens-for-writing and renames under ``directory`` (Python's audit hooks)."""
    directory = os.path.realpath(directory)

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR)
            if writing and os.path.realpath(os.fsdecode(args[0])).startswith(directory):
                log.append(("open", os.fsdecode(args[0])))
        elif event in ("os.rename", "os.remove") and os.path.realpath(os.fsdecode(args[0])).startswith(directory):
            log.append((event, os.fsdecode(args[0])))

    sys.addaudithook(hook)


def _scenarios(rank, world_size, root):
    out = {}
    # 1. uninterrupted reference (dir a); its writes on this rank are audited
    writes = []
    _audit_writes(os.path.join(root, "a"), writes)
    trainer_a, summary_a = _train(os.path.join(root, "a"))
    out["a_params"] = _params(trainer_a.model)
    out["a_summary"] = summary_a
    out["writes"] = writes
    # 2. crash after step 7 (newest checkpoint: step 6, mid-epoch), then resume from a fresh, differently
    #    initialised model in the same processes (the RNG has moved on since the checkpoint)
    crashed, none = _train(os.path.join(root, "b"), crash_at=7)
    assert none is None and crashed.step == 7
    with contextlib.redirect_stdout(io.StringIO()) as said_b:
        resumed_b, summary_b = _train(os.path.join(root, "b"), init_seed=99, resume=True)
    out["b_said"] = said_b.getvalue()
    out["b_params"] = _params(resumed_b.model)
    out["b_resumed_from"] = str(resumed_b.resumed_from)
    out["b_summary"] = summary_b
    out["b_run_ids"] = (crashed.run_id, resumed_b.run_id)
    # 3. checkpoint exactly at an epoch's last step (5 steps per epoch), crash in the next epoch
    _train(os.path.join(root, "c"), crash_at=8, save_every_steps=5)
    with contextlib.redirect_stdout(io.StringIO()) as said_c:
        resumed_c, _ = _train(os.path.join(root, "c"), init_seed=98, resume=True, save_every_steps=5)
    out["c_params"] = _params(resumed_c.model)
    out["c_said"] = said_c.getvalue()
    # ... and resumed again: nothing left (3 of 3 epochs; then max_steps reached), said, nothing written
    c_files = sorted(os.listdir(os.path.join(root, "c")))
    for key, more in (("c_done_epochs", {}), ("c_done_steps", {"epochs": 5, "max_steps": 15})):
        with contextlib.redirect_stdout(io.StringIO()) as said:
            _, summary = _train(os.path.join(root, "c"), resume=True, save_every_steps=5, **more)
        out[key] = (said.getvalue(), summary["steps"], summary["samples_per_s"])
    out["c_files_unchanged"] = sorted(os.listdir(os.path.join(root, "c"))) == c_files
    # 4. stop early with max_steps, then continue with the full budget
    _train(os.path.join(root, "d"), max_steps=4, save_every_steps=None)
    resumed_d, _ = _train(os.path.join(root, "d"), init_seed=97, resume=True, save_every_steps=None)
    out["d_params"] = _params(resumed_d.model)
    # 5. exact evaluation, against a single-process pass over the whole eval set
    ev = resumed_b.evaluate()
    x, y = _data(N_EVAL, 1).tensors
    resumed_b.model.eval()
    with torch.no_grad():
        logits = resumed_b.model(x)
    out["eval"] = ev
    out["eval_ref"] = {"eval_loss": nn.functional.cross_entropy(logits, y).item(),
                       "eval_accuracy": (logits.argmax(1) == y).sum().item() / N_EVAL}
    # 6. accumulation: 2 micro-batches of 4 under no_sync vs 1 batch of 8 (no dropout, no clipping)
    finals = []
    for bs, accum in ((8, 1), (4, 2)):
        model = _model(5, dropout=0.0)
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                    _data(64, 2), None, TrainerConfig(epochs=2, batch_size=bs, grad_accum_steps=accum, progress=False))
        t.fit()
        finals.append(_params(model))
    out["accum"] = finals
    # 7. linear scaling (global batch 16 over base 8: x2) with 3 warm-up steps, and bf16 autocast
    model = _model(6)
    lrs = []
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.cross_entropy,
                _data(64, 2), _data(N_EVAL, 1),
                TrainerConfig(epochs=1, batch_size=8, lr_scale_base_batch=8, warmup_steps=3, progress=False,
                              autocast_dtype="bfloat16"),
                on_step_end=lambda tr: lrs.append(tr.optimizer.param_groups[0]["lr"]))
    out["bf16_summary"] = t.fit()
    out["lrs"] = lrs
    out["comm"] = t.comm_report()
    # 8. the fallback measurement, as used with a DDP that keeps no account (torch's): no side effects
    model = _model(7, dropout=0.0)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(model)
    before = _params(model)
    x, y = _data(16, 4).tensors
    fallback = measure_exposed_comm(torch_ddp, lambda: nn.functional.cross_entropy(torch_ddp(x), y), reps=3)
    out["fallback"] = fallback
    out["fallback_untouched"] = _equal(before, _params(model)) and all(p.grad is None for p in model.parameters())
    # 9. clipping acts on the averaged gradient: one plain SGD step (lr 1) moves the parameters by exactly the cap
    model = _model(8, dropout=0.0)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), nn.functional.cross_entropy, _data(64, 2), None,
                TrainerConfig(batch_size=8, grad_clip_norm=1e-3, max_steps=1, progress=False))
    before = _params(model)  # after DDP's start-up broadcast of rank 0's parameters
    t.fit()
    out["clipped_step_norm"] = torch.cat([(a - b).flatten() for a, b in zip(_params(model), before)]).norm().item()
    # 10. a checkpoint from 3 ranks whose global batch (24) 2 ranks of batch_size 8 cannot make is refused on every rank
    save_atomic({"format": "lockstep-trainer-v1", "step": 1, "world_size": 3, "global_batch": 24, "batch_size": 8},
                os.path.join(root, "ckpt-000000001.pt")) if rank == 0 else None
    try:
        _train(root, resume=True, checkpoint_dir=root)
        out["world_size_error"] = None
    except ValueError as e:
        out["world_size_error"] = str(e)
    out.update(_fault_scenarios(rank, root))
    out.update(_run_identity_scenarios(rank, root))
    # 11. a NaN loss on rank 1 at the 3rd step of the 2nd epoch: the error names the step and the epoch
    calls = []

    def nan_on_rank_1(outputs, targets):
        loss = nn.functional.cross_entropy(outputs, targets)
        calls.append(1)
        return loss * float("nan") if rank == 1 and len(calls) == 8 + 3 else loss  # 8 steps per epoch

    model = _model(9, dropout=0.0)
    try:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nan_on_rank_1, _data(128, 2), None,
                TrainerConfig(epochs=2, batch_size=8, progress=False)).fit()
        out["nan_error"] = None
    except Exception as e:
        out["nan_error"] = f"{type(e).__name__}: {e}"
    return out


def _run_identity_scenarios(rank, root):
    """Issue 28, item 1: two runs into one checkpoint_dir (the old tree let the second delete its own newest
    checkpoint, keep the first run's, and mix both runs' metrics)."""
    from lockstep.train.checkpoint import checkpoint_run_id
    from lockstep.train.metrics import select_run

    out, h_dir = {}, os.path.join(root, "h")
    first, _ = _train(h_dir, max_steps=4, save_every_steps=2, keep_last=1)
    out["h_first"] = (first.run_id, [(s, checkpoint_run_id(p)) for s, p in list_checkpoints(h_dir)])
    try:  # a shorter new run into the same folder: stops before its first step, on every rank
        again, _ = _train(h_dir, max_steps=2, save_every_steps=1, keep_last=1)
        out["h_conflict"] = (None, again.step)
    except Exception as e:
        out["h_conflict"] = (f"{type(e).__name__}: {e}", [str(f) for f in getattr(e, "files", [])])
    out["h_after_conflict"] = [(s, checkpoint_run_id(p)) for s, p in list_checkpoints(h_dir)]
    second, _ = _train(h_dir, max_steps=2, save_every_steps=1, keep_last=1, overwrite=True)
    out["h_second"] = (second.run_id, [(s, checkpoint_run_id(p)) for s, p in list_checkpoints(h_dir)])
    records = read_metrics(os.path.join(h_dir, "metrics.jsonl")) if rank == 0 else []
    out["h_metrics_runs"] = sorted({r.get("run") for r in records})
    out["h_selected"] = [(r["event"], r["step"], r["run"]) for r in select_run(records)]
    return out


def _read_only_dir(path) -> str | None:
    """A directory this process cannot write to: a read-only tmpfs as root, chmod 555 otherwise; None if neither."""
    os.makedirs(path)
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return "chmod 555"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", path], capture_output=True)
    return "read-only tmpfs" if done.returncode == 0 else None


def _fault_scenarios(rank, root):
    """Checkpoint faults at the Trainer level (issue 12, sections 2 and 5); every rank must end alike."""
    import warnings

    import torch.distributed as dist

    from lockstep.train.checkpoint import CheckpointWarning

    out = {}

    def attempt(fn):
        try:
            fn()
            return None
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    # the newest checkpoint corrupted (one byte flipped): resume takes the older one, warns, ends identical
    f_dir = os.path.join(root, "f")
    _train(f_dir, crash_at=7)  # checkpoints 3 and 6
    if rank == 0:
        newest = os.path.join(f_dir, "ckpt-000000006.pt")
        data = bytearray(open(newest, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(newest, "wb").write(bytes(data))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed_f, _ = _train(f_dir, init_seed=96, resume=True)
    out["f_params"] = _params(resumed_f.model)
    out["f_resumed_from"] = str(resumed_f.resumed_from)
    out["f_warnings"] = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    # a checkpoint from another model, newer than the good ones: an error naming the keys, on every rank
    if rank == 0:
        other = nn.Sequential(nn.Linear(6, 3))
        save_atomic({"format": "lockstep-trainer-v1", "step": 99, "world_size": 2, "model": other.state_dict()},
                    os.path.join(f_dir, "ckpt-000000099.pt"))
    dist.barrier()
    out["other_model_error"] = attempt(lambda: _train(f_dir, resume=True))
    # a save that fails on rank 0 (a directory squats on the file name): every rank raises, or every rank goes on
    for mode in ("raise", "continue"):
        g_dir = os.path.join(root, f"g_{mode}")
        if rank == 0:
            os.makedirs(os.path.join(g_dir, "ckpt-000000003.pt", "squatter"))
        dist.barrier()
        holder = {}
        out[f"save_{mode}"] = attempt(lambda: holder.update(t=_train(g_dir, on_save_error=mode)[0]))
        if "t" in holder:
            out[f"save_{mode}_steps"] = holder["t"].step
            out[f"save_{mode}_errors"] = holder["t"].save_errors
    # a checkpoint directory nobody can write to: every rank fails before the first step
    ro_dir = os.path.join(root, "read-only")
    how = [_read_only_dir(ro_dir) if rank == 0 else None]
    dist.broadcast_object_list(how, src=0)
    out["read_only_how"] = how[0]
    if how[0]:
        out["read_only_error"] = attempt(lambda: _train(ro_dir))
        if rank == 0 and how[0].endswith("tmpfs"):
            subprocess.run(["umount", ro_dir], check=False)
    # fewer samples than ranks: refused at construction, on every rank alike
    model = _model(0)
    out["small_data_error"] = attempt(lambda: Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                      nn.functional.cross_entropy, _data(1, 0)))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trainer"))
    return root, run_ranks(_scenarios, world_size=2, args=(root,), timeout_s=240)


def _equal(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_resume_after_crash_is_bit_identical(results):
    root, out = results
    for rank in range(2):
        assert out[rank]["b_resumed_from"].endswith("ckpt-000000006.pt")
        assert _equal(out[rank]["a_params"], out[rank]["b_params"]), f"rank {rank}: mid-epoch resume diverged"
        assert _equal(out[rank]["a_params"], out[rank]["c_params"]), f"rank {rank}: epoch-end resume diverged"
        assert _equal(out[rank]["a_params"], out[rank]["d_params"]), f"rank {rank}: max_steps resume diverged"
    assert _equal(out[0]["a_params"], out[1]["a_params"])  # DDP kept the ranks together
    assert out[0]["a_summary"]["steps"] == 15 and out[0]["b_summary"]["steps"] == 15
    # the resumed run's epoch summaries match the uninterrupted ones, loss means included
    a_epochs = {r["epoch"]: r for r in read_metrics(os.path.join(root, "a", "metrics.jsonl")) if r["event"] == "epoch"}
    b_epochs = {r["epoch"]: r for r in read_metrics(os.path.join(root, "b", "metrics.jsonl")) if r["event"] == "epoch"}
    for epoch in (1, 2):
        for key in ("train_loss", "eval_loss", "eval_accuracy", "eval_samples"):
            assert a_epochs[epoch][key] == b_epochs[epoch][key], (epoch, key)


def test_a_resumed_run_says_where_it_resumed_or_that_nothing_is_left(results):
    # issue 34, item 5: no run said where it resumed; one with nothing left ended silently at "0 samples/s"
    root, out = results
    b, c = os.path.join(root, "b"), os.path.join(root, "c")
    said = out[0]["b_said"].splitlines()
    assert said[0] == f"lockstep: resumed from step 6 (epoch 2 of 3, batch 2 of 10) out of {b}/ckpt-000000006.pt"
    assert out[0]["c_said"].splitlines()[0] == (f"lockstep: resumed from step 5 (epoch 1 of 3, batch 10 of 10) out of "
                                                f"{c}/ckpt-000000005.pt")
    assert out[0]["c_done_epochs"] == (f"lockstep: nothing to train: the checkpoint {c}/ckpt-000000015.pt finished "
                                       f"epoch 3 of 3; set TrainerConfig.epochs above 3 to train further\n", 15, 0.0)
    assert out[0]["c_done_steps"] == (f"lockstep: nothing to train: the checkpoint {c}/ckpt-000000015.pt is at "
                                      f"step 15, TrainerConfig.max_steps=15; raise max_steps (or leave it None) to "
                                      f"train further\n", 15, 0.0)
    for rank in range(2):
        assert out[rank]["c_files_unchanged"]
    assert out[1]["b_said"] == out[1]["c_said"] == "" and out[1]["c_done_epochs"][0] == ""  # rank 0 speaks


def test_checkpoints_keep_last_k_and_load_weights_only(results):
    root, out = results
    steps = [step for step, _ in list_checkpoints(os.path.join(root, "a"))]
    assert steps == [12, 15]  # every 3 steps, the last 2 kept
    assert not [n for n in os.listdir(os.path.join(root, "a")) if ".tmp" in n]
    payload = load_checkpoint(os.path.join(root, "a", "ckpt-000000015.pt"))
    assert payload["step"] == 15 and payload["world_size"] == 2
    assert [r["sampler"]["rank"] for r in payload["ranks"]] == [0, 1]
    # each rank's RNG is its own: dropout draws differ between ranks
    assert not torch.equal(payload["ranks"][0]["rng"]["torch"], payload["ranks"][1]["rng"]["torch"])
    final = [t for t in payload["model"].values()]
    assert _equal(final, out[0]["a_params"])


def test_only_global_rank_0_writes_files(results):
    _, out = results
    kinds = {kind for kind, _ in out[0]["writes"]}
    assert {"open", "os.rename", "os.remove"} <= kinds  # checkpoints, metrics, renames, pruning: all seen
    assert out[1]["writes"] == []


def test_evaluation_counts_every_sample_once(results):
    _, out = results
    for rank in range(2):
        ev, ref = out[rank]["eval"], out[rank]["eval_ref"]
        assert ev["eval_samples"] == N_EVAL
        assert ev["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6)
        assert ev["eval_accuracy"] == pytest.approx(ref["eval_accuracy"], abs=1e-12)
        assert out[rank]["a_summary"]["eval_samples"] == N_EVAL


def test_gradient_accumulation_matches_the_full_batch(results):
    _, out = results
    full, accumulated = out[0]["accum"]
    for a, b in zip(full, accumulated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not _equal(full, [p.detach() for p in _model(5, dropout=0.0).parameters()])  # it did train


def test_linear_scaling_warmup_and_bf16(results):
    _, out = results
    # lr(step) = 0.01 * 2 * min(1, (step + 1) / 4), read after each step's scheduler.step()
    expected = [0.02 * min(1.0, (s + 1) / 4) for s in range(1, 5)]
    assert out[0]["lrs"] == pytest.approx(expected)
    summary = out[0]["bf16_summary"]
    assert summary["steps"] == 4 and summary["eval_samples"] == N_EVAL
    assert summary["train_loss"] == summary["train_loss"]  # not NaN
    assert 0.0 <= out[0]["comm"]["comm_share"] <= 1.0
    assert "ddp.comm_stats()" in out[0]["comm"]["method"]


def test_fallback_comm_measurement_has_no_side_effects(results):
    _, out = results
    for rank in range(2):
        fb = out[rank]["fallback"]
        assert 0.0 <= fb["comm_share"] <= 1.0 and fb["synced_step_s"] > 0 and fb["local_step_s"] > 0
        assert out[rank]["fallback_untouched"]


def test_clipping_caps_the_averaged_gradient(results):
    _, out = results
    for rank in range(2):
        assert out[rank]["clipped_step_norm"] == pytest.approx(1e-3, rel=1e-4)


def test_resume_refuses_a_checkpoint_from_another_world_size(results):
    _, out = results
    for rank in range(2):
        assert "global batch 24 cannot be made at world size 2 with batch_size=8" in out[rank]["world_size_error"]
        assert "(3 ranks)" in out[rank]["world_size_error"] and "\n" not in out[rank]["world_size_error"]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"TrainerConfig.batch_size must be an int >= 1, got 0"):
        TrainerConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"TrainerConfig.grad_accum_steps must be an int >= 1"):
        TrainerConfig(grad_accum_steps=1.5)
    with pytest.raises(ValueError, match=r"TrainerConfig.warmup_steps must be an int >= 0, got -1"):
        TrainerConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match=r"TrainerConfig.grad_clip_norm must be a number > 0"):
        TrainerConfig(grad_clip_norm=0.0)
    with pytest.raises(ValueError, match=r"TrainerConfig.autocast_dtype must be None or one of"):
        TrainerConfig(autocast_dtype="float8")  # float16 is accepted now, with a GradScaler
    with pytest.raises(ValueError, match=r"TrainerConfig.overwrite needs TrainerConfig.checkpoint_dir"):
        TrainerConfig(overwrite=True)
    with pytest.raises(ValueError, match=r"TrainerConfig.resume and TrainerConfig.overwrite exclude each other"):
        TrainerConfig(resume=True, overwrite=True, checkpoint_dir="x")
    with pytest.raises(ValueError, match=r"TrainerConfig.resume needs TrainerConfig.checkpoint_dir"):
        TrainerConfig(resume=True)
    with pytest.raises(ValueError, match=r"TrainerConfig.save_every_steps needs TrainerConfig.checkpoint_dir"):
        TrainerConfig(save_every_steps=10)
    with pytest.raises(ValueError, match=r"TrainerConfig.keep_last must be an int >= 1, got 0"):
        TrainerConfig(keep_last=0)


def test_trainer_without_process_group_says_so():
    model = _model(0)
    with pytest.raises(RuntimeError, match=r"needs an initialised process group: call lockstep.init\(\)"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, _data(8, 0))


def _elastic_worker(directory, marker):
    """One rank under torch's elastic agent: rank 1 is SIGKILLed after step 7 on the first attempt."""
    import lockstep

    torch.set_num_threads(1)  # as in run_ranks: the reference run's numerics
    env = lockstep.init(backend="gloo")
    first_attempt = not os.path.exists(marker)

    def die(trainer):
        if first_attempt and trainer.step == 7 and env.rank == 1:
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: the process is gone

    try:
        trainer, _ = _train(directory, resume=True, on_step_end=die)
        return {"params": _params(trainer.model), "resumed_from": trainer.resumed_from, "first": first_attempt}
    finally:
        lockstep.shutdown()


@full_only("~45 s: a launch with a restart; tests/test_faults.py's kill runs resume under the agent by default")
def test_killed_rank_restarted_by_the_elastic_agent_resumes_exactly(results, tmp_path):
    """The production path: a worker dies, `lockstep launch --max-restarts` restarts the group, resume=True."""
    _, out = results
    marker = str(tmp_path / "killed-once")
    finals = launch_function(_elastic_worker, args=(str(tmp_path / "e"), marker), nproc_per_node=2, max_restarts=1)
    assert os.path.exists(marker)  # the kill happened
    for rank in range(2):
        assert not finals[rank]["first"]  # these results come from the restarted attempt
        assert finals[rank]["resumed_from"].endswith("ckpt-000000006.pt")
        assert _equal(finals[rank]["params"], out[rank]["a_params"]), f"rank {rank} diverged after the restart"


# ---------------------------------------------------------------- faults (issue 12, sections 2 and 5)


def test_corrupted_newest_checkpoint_is_skipped_with_a_warning_and_resume_stays_exact(results):
    _, out = results
    for rank in range(2):
        assert out[rank]["f_resumed_from"].endswith("ckpt-000000003.pt")
        assert _equal(out[rank]["f_params"], out[rank]["a_params"]), f"rank {rank} diverged"
    (warning,) = out[0]["f_warnings"]  # rank 0 chose, and says so once
    assert "skipping checkpoint" in warning and "ckpt-000000006.pt: checksum mismatch" in warning
    assert "resuming from" in warning and warning.endswith("ckpt-000000003.pt")


def test_checkpoint_from_another_model_names_missing_and_unexpected_keys(results):
    _, out = results
    for rank in range(2):
        error = out[rank]["other_model_error"]
        assert error.startswith("ValueError: checkpoint ") and "ckpt-000000099.pt is from another model" in error
        assert "missing keys: 3.bias, 3.weight; unexpected keys: none" in error
        assert "shape mismatches: 0.bias: (3,) saved, (32,) here, 0.weight: (3, 6) saved, (32, 6) here" in error


def test_failed_save_raises_on_every_rank_or_goes_on_as_configured(results):
    _, out = results
    for rank in range(2):
        error = out[rank]["save_raise"]
        assert error.startswith("CheckpointSaveError: [Errno 21] checkpoint ")
        assert "ckpt-000000003.pt could not be written: [Errno 21] Is a directory" in error
        assert f"(reported by global rank 0 to rank {rank})" in error
        assert "there is no previous checkpoint" in error
        assert out[rank]["save_continue"] is None and out[rank]["save_continue_steps"] == 15
        (failure,) = out[rank]["save_continue_errors"]
        assert "ckpt-000000003.pt could not be written" in failure


def test_unwritable_checkpoint_dir_fails_every_rank_before_training(results):
    _, out = results
    if out[0]["read_only_how"] is None:
        pytest.skip("running as root where mount is not allowed: no way to make a directory read-only")
    for rank in range(2):
        error = out[rank]["read_only_error"]
        assert error.startswith("CheckpointSaveError: [Errno 30] TrainerConfig.checkpoint_dir ")
        assert "read-only is not writable: Read-only file system" in error
        assert "checked by global rank 0 before training" in error


# ---------------------------------------------------------------- run identity (issue 28, item 1)


def test_a_new_run_never_deletes_or_mixes_with_another_runs_checkpoints(results):
    _, out = results
    first_id, first_ckpts = out[0]["h_first"]
    assert first_ckpts == [(4, first_id)]  # keep_last=1 of its own run; the metadata names the run
    for rank in range(2):
        assert out[rank]["h_first"][0] == first_id  # rank 0's id, on every rank
        error, files = out[rank]["h_conflict"]
        assert error is not None, f"rank {rank}: the second run trained {files} steps into the first run's folder"
        assert error.startswith("RunConflictError: ") and "h holds checkpoints of another run" in error
        assert f"run {first_id}: ckpt-000000004.pt" in error
        assert "TrainerConfig.resume=True" in error and "another checkpoint_dir" in error
        assert "TrainerConfig.overwrite=True" in error and "\n" not in error
        assert [os.path.basename(f) for f in files] == ["ckpt-000000004.pt"]
    assert out[0]["h_after_conflict"] == first_ckpts  # nothing deleted, nothing written
    second_id, second_ckpts = out[0]["h_second"]
    assert second_id != first_id and second_ckpts == [(2, second_id)]  # overwrite: the first run's are gone
    # metrics: both runs' lines stay in the file, each named; select_run keeps the new run's only
    assert out[0]["h_metrics_runs"] == sorted([first_id, second_id])
    selected = out[0]["h_selected"]
    assert selected[0] == ("start", 0, second_id) and {run for _, _, run in selected} == {second_id}
    assert [step for event, step, _ in selected if event == "train"] == [1, 2]


def test_a_resumed_run_keeps_its_run_id(results):
    _, out = results
    for rank in range(2):
        crashed_id, resumed_id = out[rank]["b_run_ids"]
        assert crashed_id and resumed_id == crashed_id
    assert out[0]["b_run_ids"] == out[1]["b_run_ids"]


def test_nonfinite_error_names_the_step_and_the_epoch(results):
    # issue 28, item 8: the error named the rank and the parameter, not when
    _, out = results
    for rank in range(2):
        error = out[rank]["nan_error"]
        assert error.startswith("NonfiniteGradientError: at optimizer step 11 (epoch 2, batch 3 of 8): "
                                "non-finite gradient on rank 1"), error


def test_dataset_smaller_than_the_world_is_refused(results):
    _, out = results
    for rank in range(2):
        assert out[rank]["small_data_error"] == ("ValueError: Trainer: train_data has 1 samples, fewer than the 2 "
                                                 "ranks; every rank needs at least one sample of its own")
