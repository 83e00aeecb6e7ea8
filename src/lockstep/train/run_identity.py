"""Run identity: which run a checkpoint belongs to, so one run never deletes or resumes another's.

Every checkpoint's metadata (``ckpt-<step>.meta.json``) carries the ``run_id`` of the run that
wrote it, and every metrics line carries it as ``run``. A resumed run adopts the id of the
checkpoint it loads, so its files stay one run; a new run gets a fresh id. The one idea: a
folder holds one run. A new run that finds another run's checkpoints stops before its first
step with an error naming them and the three ways on (resume that run, another folder, or
overwrite), and pruning only ever looks at the run's own checkpoints, newest step kept.

Without this, pruning kept "the newest by step number" across runs: a 1-epoch run into the
folder of a 2-epoch run deleted its own checkpoint (step 23) and kept the old run's (step 46),
which a later ``--resume`` then continued.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from lockstep.train.checkpoint_files import (
    checkpoint_run_id,
    list_checkpoints,
    meta_path,
)

__all__ = [
    "RunConflictError",
    "checkpoint_run_id",
    "conflict_message",
    "foreign_checkpoints",
    "new_run_id",
    "remove_checkpoints",
]


class RunConflictError(FileExistsError):
    """A new run was asked to train in a folder that holds another run's checkpoints.

    ``directory`` and ``files`` (the other run's checkpoint paths, oldest first) say what was found.
    """

    def __init__(self, message: str, directory: str | os.PathLike, files: list[Path]):
        super().__init__(message)
        self.directory, self.files = Path(directory), list(files)


def new_run_id() -> str:
    """A fresh id: the start time (readable, sorts by start) and 6 random hex digits (two runs in one second)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def foreign_checkpoints(directory: str | os.PathLike, run_id: str | None) -> list[tuple[int, Path, str | None]]:
    """(step, path, run id) of the checkpoints in ``directory`` not written by run ``run_id``, oldest first.

    ``run_id`` None: every checkpoint there is foreign (the caller has no run yet). A checkpoint
    without a run id (written before run ids existed) never belongs to a run.
    """
    found = []
    for step, path in list_checkpoints(directory):
        if not path.is_file():  # a directory squatting on a checkpoint's name holds no run
            continue
        owner = checkpoint_run_id(path)
        if run_id is None or owner != run_id:
            found.append((step, path, owner))
    return found


def conflict_message(directory: str | os.PathLike, foreign: list[tuple[int, Path, str | None]], choices: str) -> str:
    """One line: the folder, the other run's checkpoints (at most 3 named, then a count) and ``choices``."""
    names = [path.name for _, path, _ in foreign]
    shown = ", ".join(names[-3:]) + (f" and {len(names) - 3} older" if len(names) > 3 else "")
    runs = sorted({owner or "unknown (written before run ids)" for _, _, owner in foreign})
    return (f"{directory} holds checkpoints of another run (run {', '.join(runs)}: {shown}); "
            f"this new run stops before training rather than mix with it or delete it: {choices}")


def remove_checkpoints(paths: list[Path]) -> None:
    """Delete checkpoints and their metadata (the metadata first: a half-deleted one reads as unfinished)."""
    for path in paths:
        meta_path(path).unlink(missing_ok=True)
        path.unlink(missing_ok=True)


def claim_checkpoint_dir(directory: str | os.PathLike, run_id: str, resumed: bool, overwrite: bool,
                         is_writer: bool, group=None) -> list[Path]:
    """Make ``directory`` this run's before its first step, or raise RunConflictError on every rank.

    A resumed run owns its folder already. A new run finding another run's checkpoints raises,
    unless ``overwrite``: then global rank 0 deletes them (returned). A collective: rank 0 looks,
    then broadcasts what it found (one small broadcast per fit), so every rank stops alike.
    """
    import torch.distributed as dist

    status: list = [None, []]
    if is_writer and not resumed:
        foreign = foreign_checkpoints(directory, run_id)
        if foreign and overwrite:
            remove_checkpoints([path for _, path, _ in foreign])
            status = [None, [str(path) for _, path, _ in foreign]]
        elif foreign:
            status = [conflict_message(directory, foreign, "resume it (TrainerConfig.resume=True), give this run "
                                       "another checkpoint_dir, or replace it (TrainerConfig.overwrite=True)"),
                      [str(path) for _, path, _ in foreign]]
    dist.broadcast_object_list(status, src=0, group=group)
    if status[0] is not None:
        raise RunConflictError(status[0], directory, [Path(p) for p in status[1]])
    return [Path(p) for p in status[1]]
