"""Checkpoints that resume a run exactly: atomic files, every rank's RNG, read back without unpickling code.

A checkpoint is one file ``ckpt-<step>.pt`` written by global rank 0 only: model,
optimizer, scheduler, step, each rank's sampler position and each rank's RNG states
(torch, numpy, Python's ``random``; CUDA's when present) — ranks draw different
dropout masks, so one rank's RNG is not enough. Everything is stored as tensors and
plain containers so ``torch.load(weights_only=True)`` reads it: loading a checkpoint
never runs code from the file. The files themselves (atomic writes, the SHA-256 in
``ckpt-<step>.meta.json``, finding the newest good one) are ``checkpoint_files``; this
module gathers what each rank must keep and puts it back. With ``TrainerConfig.zero`` every
rank also writes its optimizer shard as a part file first (``zero``), and the checkpoint
names the parts instead of holding the optimizer's state.
"""

from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lockstep.train import diloco, resize, zero
from lockstep.train.checkpoint_files import (  # noqa: F401  (re-exported: the public file API)
    FORMAT,
    UNFINISHED,
    CheckpointSaveError,
    checkpoint_path,
    checkpoint_run_id,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    meta_path,
    newest_good_checkpoint,
    probe_writable,
    prune_checkpoints,
    remove_stale_temporaries,
    save_atomic,
    verify,
)
from lockstep.train.fence import JobFence, JobFenceError, StaleGenerationError, job_id_from_env
from lockstep.train.preempt import note_checkpoint
from lockstep.train.run_identity import new_run_id


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on resume (truncated, corrupted, unfinished); the message names it and why."""


# -- RNG states as weights_only-safe values ----------------------------------------------
def capture_rng_state() -> dict:
    """This process's RNG states as tensors, ints, floats and strings."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(np_name),
            # uint32 keys kept exactly in int64 (torch has no general uint32 support)
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss_next,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state(
        (npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- the Trainer's checkpoint ------------------------------------------------------------
@dataclass(frozen=True)
class Saved:
    """What a save did, the same on every rank: the checkpoint written, or the error training goes on after."""

    path: Path | None  # the file global rank 0 wrote (None on the other ranks, and after an error)
    checkpoint: Path | None  # that checkpoint's path, on every rank (None after an error)
    error: str | None  # why it failed, under on_error "continue"


def save_trainer_checkpoint(trainer, on_error: str | None = None) -> Saved:
    """Gather every rank's sampler position, RNG states and epoch loss; global rank 0 writes atomically.

    A collective: every rank of ``trainer.group`` must call it at the same step. Rank 0
    broadcasts whether its write succeeded (one small collective per checkpoint), so a
    failed save ends on every rank alike: all raise CheckpointSaveError (``on_error``
    "raise", default TrainerConfig.on_save_error) or all train on ("continue", a warning). The Trainer records
    what it returns.
    """
    on_error = on_error or trainer.config.on_save_error
    check_fence(trainer)  # a writer whose generation was passed writes nothing, not even ZeRO's parts
    mine = {"sampler": trainer.sampler.state_dict(), "rng": capture_rng_state(),
            "loss_sum": trainer._loss_sum, "loss_count": trainer._loss_count}
    outer = trainer.diloco  # DiLoCo: each rank's own model and optimizer, the synced state once (train/diloco.py)
    if outer is not None:
        mine["diloco_local"] = diloco.local_state(trainer.model, trainer.optimizer)
    outer_state = outer.state_dict() if outer is not None else None  # every rank: it waits for what is in flight
    stage = trainer.config.zero
    if stage:  # every rank's optimizer shard in a part file first; rank 0 commits the checkpoint only if all are
        mine["part_error"] = zero.save_part(trainer.optimizer, checkpoint_path(trainer.config.checkpoint_dir,
                                            trainer.step), trainer.rank, trainer.world_size, trainer.step,
                                            trainer.run_id)
    gathered = [None] * trainer.world_size if trainer.is_writer else None
    dist.gather_object(mine, gathered, dst=0, group=trainer.group)  # pickled in memory between our own ranks only
    path: Path | None = None
    status: list[str | None] = [None]  # rank 0's error, broadcast
    if trainer.is_writer:
        directory = trainer.config.checkpoint_dir
        kill = trainer._kill if trainer._kill is not None and trainer._kill.phase.startswith("ckpt") else None
        target = checkpoint_path(directory, trainer.step)
        try:
            if stage:
                zero.check_parts(target, [r.get("part_error", "") for r in gathered])  # type: ignore[union-attr]
            path = save_atomic(_payload(trainer, gathered or [], outer_state), target, kill=kill)
        except Exception as e:  # whatever it is, every rank must hear of it: rank 0 alone must not leave
            if stage:
                zero.remove_parts(target)  # parts of a checkpoint never committed
            status = [
                str(e) if isinstance(e, CheckpointSaveError) else f"checkpoint {directory}: {type(e).__name__}: {e}"
            ]
        if path is not None:
            note_checkpoint(path)  # a Ctrl-C of `lockstep launch` names it
            try:
                prune_checkpoints(directory, trainer.config.keep_last, run_id=trainer.run_id)  # this run's only
            except OSError as e:  # the new checkpoint is safe; an old one that will not go is only untidy
                warnings.warn(
                    f"lockstep: could not delete an old checkpoint in {directory}: {e}", CheckpointWarning, stacklevel=2
                )
    dist.broadcast_object_list(status, src=0, group=trainer.group)
    if status[0] is not None:
        if on_error == "raise":
            raise CheckpointSaveError(status[0] + f" (reported by global rank 0 to rank {trainer.rank})")
        if trainer.is_writer:
            warnings.warn(f"{status[0]}; training goes on (TrainerConfig.on_save_error='continue')",
                          CheckpointWarning, stacklevel=2)
        return Saved(None, None, status[0])
    return Saved(path, checkpoint_path(trainer.config.checkpoint_dir, trainer.step), None)


def claim_folder(trainer) -> JobFence:
    """The run folder's fence (train/fence.py), claimed by global rank 0 before anything is read or written; on
    every rank the same ``JobFence`` (only the writer holds its lease). Raises JobFenceError on every rank where
    another job trains into the folder. One small broadcast per fit."""
    job = job_id_from_env()
    verdict: list[Any] = [None, job or new_run_id()]  # rank 0's refusal, the job's id
    if trainer.is_writer:
        fence = JobFence(trainer.config.checkpoint_dir, verdict[1])
        try:
            fence.claim(f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
        except JobFenceError as e:
            verdict[0] = str(e)
    dist.broadcast_object_list(verdict, src=0, group=trainer.group)
    if verdict[0] is not None:
        raise JobFenceError(verdict[0])
    return fence if trainer.is_writer else JobFence(trainer.config.checkpoint_dir, verdict[1])


def check_fence(trainer) -> None:
    """Before a save: rank 0 asks whether its generation is still the folder's; a passed one raises
    StaleGenerationError on every rank (whatever on_save_error says: this job must stop). One small broadcast."""
    if trainer.fence is None:
        return
    verdict: list[str | None] = [None]
    if trainer.is_writer:
        try:
            trainer.fence.check(trainer.step)
        except StaleGenerationError as e:
            verdict[0] = str(e)
    dist.broadcast_object_list(verdict, src=0, group=trainer.group)
    if verdict[0] is not None:
        raise StaleGenerationError(verdict[0])


def _payload(trainer, gathered: list, outer_state: dict | None) -> dict:
    """Global rank 0's checkpoint: the shared state, and every rank's own (``gathered``)."""
    scheduler, stage = trainer.scheduler, trainer.config.zero
    fence = trainer.fence
    return {"format": FORMAT, "run_id": trainer.run_id, "step": trainer.step,
            "fence": None if fence is None else {"job": fence.job, "generation": fence.generation},
            "epoch": trainer.epoch,
            "batches_done": trainer.batches_done, "world_size": trainer.world_size,
            "global_batch": trainer.global_batch, "batch_size": trainer.config.batch_size,
            "target_epochs": trainer.config.epochs,  # what `lockstep demo --resume` trains up to
            "model": trainer.model.state_dict(),
            "optimizer": None if stage else trainer.optimizer.state_dict(),
            "optimizer_parts": zero.parts_entry(trainer.step, stage, trainer.world_size) if stage else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None, "ranks": gathered,
            "scaler": trainer.precision.state_dict(),  # fp16's GradScaler: scale and growth tracker
            "diloco": outer_state}


def open_writer_files(trainer) -> tuple[Any, str]:
    """Global rank 0 checks the checkpoint directory (a probe file; stale temporaries removed) and opens the
    metrics file; a failure there ends every rank alike when the Trainer is built (one small collective),
    not rank 0 alone with the others left waiting in their first step. The same broadcast carries rank 0's
    new run id to every rank (a resume replaces it with the checkpoint's). Returns the MetricsLog and the run id."""
    from lockstep.train.metrics import MetricsLog
    from lockstep.train.run_identity import new_run_id

    cfg, metrics = trainer.config, MetricsLog(None, enabled=False)
    status: list[str | None] = [None, None]  # rank 0's error, its new run id: one broadcast
    if trainer.is_writer:
        status[1] = new_run_id()
        try:
            if cfg.checkpoint_dir:
                probe_writable(cfg.checkpoint_dir)
                remove_stale_temporaries(cfg.checkpoint_dir)  # left by a writer killed mid-save
            metrics = MetricsLog(cfg.metrics_path, enabled=True)
        except CheckpointSaveError as e:
            status[0] = str(e)
        except OSError as e:
            status[0] = f"TrainerConfig.metrics_path {cfg.metrics_path} cannot be opened for writing: {e}"
    dist.broadcast_object_list(status, src=0, group=trainer.group)
    if status[0] is not None:
        raise CheckpointSaveError(status[0])
    assert status[1] is not None
    return metrics, status[1]


def _check_same_model(path, saved: dict, model: torch.nn.Module) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [
        f"{k}: {tuple(saved[k].shape)} saved, {tuple(expected[k].shape)} here"
        for k in sorted(set(saved) & set(expected))
        if hasattr(saved[k], "shape") and saved[k].shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        def few(keys):
            return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "") if keys else "none"
        raise ValueError(
            f"checkpoint {path} is from another model: missing keys: {few(missing)}; "
            f"unexpected keys: {few(unexpected)}" + (f"; shape mismatches: {few(shapes)}" if shapes else "")
        )


@dataclass(frozen=True)
class ResumedState:
    """A checkpoint read back for one Trainer and checked against it, not yet applied: ``Trainer._resume`` applies
    it (the Trainer's fields are written by the Trainer alone). At another world size the position, the loss and
    the accumulation are this rank's share at the new size (train/resize.py)."""

    path: str
    model: dict[str, Any]
    optimizer: dict[str, Any]  # the optimizer's whole state, or with ZeRO its own shard (``own_shard``)
    own_shard: bool
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None  # fp16's GradScaler
    step: int
    epoch: int
    batches_done: int  # micro-batches of the epoch done, counted at this run's world size
    run_id: str | None  # the resumed run's id (None: an older checkpoint that has none)
    sampler: dict[str, Any]  # this rank's position (at another size: the global one, which every rank continues)
    loss_sum: float  # this rank's share of the epoch's training loss so far
    loss_count: int
    rng: dict[str, Any] | None  # this rank's RNG states; None: a rank the checkpoint did not have (derived)
    diloco: dict[str, Any] | None = None  # TrainerConfig.diloco_sync_every: the synced copy, the outer optimizer
    diloco_local: dict[str, Any] | None = None  # and this rank's own model and inner optimizer (same world size)
    resized_from: int | None = None  # the checkpoint's world size, where it differs from this run's
    global_batch: int | None = None  # at another world size: the checkpoint's global batch, kept...
    grad_accum_steps: int | None = None  # ...by this many micro-batches a step at the new size

    def restore_rng(self, seed: int, rank: int) -> None:
        """This process's RNG as the checkpoint left it for ``rank`` (a new rank: derived from seed, step, rank)."""
        if self.rng is not None:
            restore_rng_state(self.rng)
        else:
            resize.derived_rng_state(seed, self.step, rank)


def load_trainer_checkpoint(trainer) -> ResumedState | None:
    """The newest good checkpoint, read on every rank and checked against ``trainer``; None if there is none.

    Rank 0 checks the checksums, newest first, skips bad files with a CheckpointWarning naming
    each and why, and broadcasts its choice, so every rank loads the same file even if a
    directory listing differs between hosts. If the only checkpoints are unfinished saves, it
    starts from step 0; if a committed one is damaged and none is good, every rank raises
    rather than silently starting over. Nothing of the Trainer changes here: it applies the state itself.
    """
    path = _choose_checkpoint(trainer)
    if path is None:
        return None
    payload = load_checkpoint(path)
    resized = _resized_position(trainer, path, payload) if payload["world_size"] != trainer.world_size else None
    _check_same_model(path, payload["model"], trainer.model)
    if (payload["scheduler"] is None) != (trainer.scheduler is None):
        raise ValueError(f"checkpoint {path} and this Trainer disagree on having an lr scheduler")
    if (payload.get("diloco") is None) != (trainer.diloco is None):
        raise ValueError(f"checkpoint {path} and this Trainer disagree on TrainerConfig.diloco_sync_every")
    optimizer, own_shard = zero.optimizer_state(trainer.config.zero, Path(path), payload, trainer.rank,
                                                trainer.world_size)
    # DiLoCo at another world size: every rank starts from the synced copy (no rank's own model is kept)
    local = payload["ranks"][trainer.rank].get("diloco_local") if resized is None else None
    shared = {"path": path, "model": payload["model"], "optimizer": optimizer, "own_shard": own_shard,
              "scheduler": payload["scheduler"], "scaler": payload.get("scaler"), "step": payload["step"],
              "epoch": payload["epoch"], "run_id": payload.get("run_id") or None, "diloco": payload.get("diloco"),
              "diloco_local": local}
    if resized is not None:
        loss_sum, loss_count = resize.merge_epoch_loss(payload["ranks"], trainer.rank)
        # rank r keeps old rank r's stream (dropout differs anyway: its samples are other ones now)
        rng = payload["ranks"][trainer.rank]["rng"] if trainer.rank < len(payload["ranks"]) else None
        return ResumedState(**shared, **resized, loss_sum=loss_sum, loss_count=loss_count, rng=rng,
                            resized_from=payload["world_size"])
    mine = payload["ranks"][trainer.rank]
    return ResumedState(**shared, batches_done=payload["batches_done"], sampler=mine["sampler"],
                        loss_sum=mine["loss_sum"], loss_count=mine["loss_count"], rng=mine["rng"])


def _choose_checkpoint(trainer) -> str | None:
    """Rank 0's choice of the newest good checkpoint, broadcast (one collective); its skips warned about."""
    choice: list[Any] = [None, []]  # [path or None, [(path, why), ...]]: one broadcast
    if trainer.is_writer:
        good, skipped_paths = newest_good_checkpoint(trainer.config.checkpoint_dir)
        choice = [str(good) if good else None, [(str(p), why) for p, why in skipped_paths]]
    dist.broadcast_object_list(choice, src=0, group=trainer.group)
    path: str | None = choice[0]
    skipped: list[tuple[str, str]] = choice[1]
    if trainer.is_writer:
        for bad, why in skipped:
            warnings.warn(
                f"lockstep: skipping checkpoint {bad}: {why}; "
                f"{'resuming from ' + path if path else 'no older good one'}",
                CheckpointWarning,
                stacklevel=3,
            )
    if path is None:
        # only unfinished saves (killed before their metadata): as if there were none, start from step 0;
        # a committed checkpoint that is damaged, with nothing older, is data lost: say so, do not start over
        damaged = [(bad, why) for bad, why in skipped if not why.startswith(UNFINISHED)]
        if damaged:
            raise RuntimeError(f"no good checkpoint in {trainer.config.checkpoint_dir}: "
                               + "; ".join(f"{bad}: {why}" for bad, why in damaged))
    return path


def _resized_position(trainer, path: str, payload: dict) -> dict[str, Any]:
    """A checkpoint of another world size: the same global batch at this one (train/resize.py), checked before
    anything changes; the global position every rank continues from."""
    if "global_batch" not in payload:
        raise ValueError(f"checkpoint {path} was written by {payload['world_size']} ranks without its global "
                         f"batch (an older lockstep); this run has {trainer.world_size}: resume it at "
                         f"{payload['world_size']} ranks")
    global_batch = payload["global_batch"]
    if trainer.config.global_batch is not None and trainer.config.global_batch != global_batch:
        raise ValueError(f"checkpoint {path} trains with global batch {global_batch}; this run's "
                         f"TrainerConfig.global_batch is {trainer.config.global_batch}")
    accum = resize.accum_steps_for(global_batch, trainer.config.batch_size, trainer.world_size,
                                   f"checkpoint {path} ({payload['world_size']} ranks)")
    shared = resize.global_position(payload["ranks"], path)
    position = shared.get("position", shared["consumed"] * payload["world_size"])
    batches_done = resize.batches_done_at(position, payload["batches_done"], trainer.config.batch_size,
                                          trainer.world_size, path)
    return {"global_batch": global_batch, "grad_accum_steps": accum, "batches_done": batches_done,
            "sampler": shared}
