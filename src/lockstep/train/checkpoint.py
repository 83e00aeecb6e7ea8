"""Checkpoints that resume a run exactly: atomic files, every rank's RNG, read back without unpickling code.

A checkpoint is one file ``ckpt-<step>.pt`` written by global rank 0 only: model,
optimizer, scheduler, step, each rank's sampler position and each rank's RNG states
(torch, numpy, Python's ``random``; CUDA's when present) — ranks draw different
dropout masks, so one rank's RNG is not enough. Everything is stored as tensors and
plain containers so ``torch.load(weights_only=True)`` reads it: loading a checkpoint
never runs code from the file. Writing is atomic (temporary file in the same
directory, fsync, rename, fsync of the directory), so a crash mid-write leaves the
previous checkpoint intact and never a half-written newest one.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "lockstep-trainer-v1"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


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


# -- files ---------------------------------------------------------------------------------
def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    # zero-padded so a directory listing sorts by step, for people as well as for list_checkpoints
    return Path(directory) / f"ckpt-{step:09d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in ``directory``, oldest first; temporaries are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_atomic(payload: dict, path: str | os.PathLike) -> Path:
    """Write ``payload`` to ``path`` so that ``path`` is either absent, the old file, or complete.

    Cost: one fsync of the file and one of the directory (milliseconds on a local disk,
    more on network file systems) per checkpoint.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary lives in the same directory: os.replace is atomic only within a file system
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return path


def prune_checkpoints(directory: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints; returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"prune_checkpoints: keep_last must be >= 1, got {keep_last}")
    found = list_checkpoints(directory)
    doomed = [path for _, path in found[:-keep_last]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint with ``weights_only=True`` and check it is one of ours."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"checkpoint {path} could not be read safely (weights_only=True): {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} is not a lockstep Trainer checkpoint (format {FORMAT!r})")
    return payload


# -- the Trainer's checkpoint ------------------------------------------------------------
def save_trainer_checkpoint(trainer) -> Path | None:
    """Gather every rank's sampler position, RNG states and epoch loss; global rank 0 writes atomically.

    A collective: every rank of ``trainer.group`` must call it at the same step.
    """
    mine = {"sampler": trainer.sampler.state_dict(), "rng": capture_rng_state(),
            "loss_sum": trainer._loss_sum, "loss_count": trainer._loss_count}
    gathered = [None] * trainer.world_size if trainer.is_writer else None
    dist.gather_object(mine, gathered, dst=0, group=trainer.group)  # pickled in memory between our own ranks only
    trainer._saved_step = trainer.step
    if not trainer.is_writer:
        return None
    scheduler = trainer.scheduler
    payload = {"format": FORMAT, "step": trainer.step, "epoch": trainer.epoch, "batches_done": trainer.batches_done,
               "world_size": trainer.world_size, "model": trainer.model.state_dict(),
               "optimizer": trainer.optimizer.state_dict(),
               "scheduler": scheduler.state_dict() if scheduler is not None else None, "ranks": gathered}
    directory = trainer.config.checkpoint_dir
    path = save_atomic(payload, checkpoint_path(directory, trainer.step))
    prune_checkpoints(directory, trainer.config.keep_last)
    trainer.last_checkpoint = path
    return path


def load_trainer_checkpoint(trainer) -> str | None:
    """Load the newest checkpoint into ``trainer`` on every rank; None (and no change) if there is none.

    Rank 0 picks the file and broadcasts its name, so every rank loads the same one even
    if a directory listing differs between hosts.
    """
    choice = [str(latest_checkpoint(trainer.config.checkpoint_dir) or "") if trainer.is_writer else None]
    dist.broadcast_object_list(choice, src=0, group=trainer.group)
    path = choice[0]
    if not path:
        return None
    payload = load_checkpoint(path)
    if payload["world_size"] != trainer.world_size:
        raise ValueError(f"checkpoint {path} was written by {payload['world_size']} ranks; this run has "
                         f"{trainer.world_size}, and an exact resume needs the same number")
    if (payload["scheduler"] is None) != (trainer.scheduler is None):
        raise ValueError(f"checkpoint {path} and this Trainer disagree on having an lr scheduler")
    trainer.model.load_state_dict(payload["model"])
    trainer.optimizer.load_state_dict(payload["optimizer"])
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(payload["scheduler"])
    trainer.step, trainer.epoch, trainer.batches_done = payload["step"], payload["epoch"], payload["batches_done"]
    trainer._saved_step = trainer.step
    mine = payload["ranks"][trainer.rank]
    trainer.sampler.load_state_dict(mine["sampler"])
    trainer._loss_sum, trainer._loss_count = mine["loss_sum"], mine["loss_count"]
    restore_rng_state(mine["rng"])  # last: nothing after this may draw randomness
    trainer.last_checkpoint = trainer.resumed_from = path
    return path
