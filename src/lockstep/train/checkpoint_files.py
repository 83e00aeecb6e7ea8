"""Checkpoint files that cannot be lost: atomic writes, a checksum beside each file, the newest good one found.

A checkpoint is two files: ``ckpt-<step>.pt`` (plain ``torch.save``; ``torch.load`` reads it
anywhere) and ``ckpt-<step>.meta.json`` (its size and SHA-256, the step, the format, the run id). The
metadata is written last, so it is the commit record: a ``.pt`` without one never finished
saving. Integrity is decided by the checksum before anything is unpickled, so a flipped
byte, a truncated or zero-length file and a half-written one are all told apart from a
good file by what they are, not by how unpickling happens to fail.

Writing: temporary file in the same directory, SHA-256 computed while the bytes go out (no
second read), fsync, rename, then the metadata the same way, then an fsync of the
directory. A crash at any point leaves every older checkpoint intact. A full disk is an
error that names the path and the free space, and leaves no temporary behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from pathlib import Path

import torch

from lockstep.train.faults import CKPT_WRITE_KILL_AFTER_NBYTES, KillPoint, maybe_kill

FORMAT = "lockstep-trainer-v1"
UNFINISHED = "no metadata file "  # how verify() begins the reason for a save that never committed
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # full disk, quota, file-size limit (RLIMIT_FSIZE)


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed; the message names the file, the cause and (disk full) the free space."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    # zero-padded so a directory listing sorts by step, for people as well as for list_checkpoints
    return Path(directory) / f"ckpt-{step:09d}.pt"


def meta_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name.removesuffix(".pt") + ".meta.json")


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every ``ckpt-<step>.pt`` in ``directory``, oldest first; temporaries are ignored."""
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


def free_mb(directory: str | os.PathLike) -> float:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize / 2**20


class _HashingWriter:
    """The file object torch.save writes through: hashes every byte on its way out (~1.5 GB/s here)."""

    def __init__(self, f, kill: KillPoint | None, step: int):
        self.f, self.sha256, self.nbytes = f, hashlib.sha256(), 0
        self.error: OSError | None = None
        self.kill, self.step = kill, step

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as e:
            self.error = e  # torch's zip writer raises its own RuntimeError on top of this one as it unwinds
            raise
        self.sha256.update(data)
        self.nbytes += len(data)
        if self.kill is not None and self.nbytes >= CKPT_WRITE_KILL_AFTER_NBYTES:
            self.f.flush()  # the bytes so far reach the file: a torn temporary, as a real crash leaves
            maybe_kill(self.kill, "ckpt_write", self.step)
        return written

    def flush(self) -> None:
        self.f.flush()


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _save_error(path: Path, e: OSError, nbytes: int) -> CheckpointSaveError:
    older = [p.name for _, p in list_checkpoints(path.parent) if p != path]
    kept = f"the previous checkpoint {older[-1]} is intact" if older else "there is no previous checkpoint"
    # (the temporary is already deleted here, so the free space is what a retry would have)
    if e.errno in _NO_SPACE:
        try:
            space = f"{free_mb(path.parent):.1f} MB free"
        except OSError:
            space = "free space unknown"
        return CheckpointSaveError(
            e.errno, f"checkpoint {path} could not be written: {e.strerror or e} after {nbytes / 2**20:.1f} MB "
            f"were written ({space} on the file system of {path.parent} once the partial file was removed); {kept}")
    return CheckpointSaveError(e.errno, f"checkpoint {path} could not be written: {e}; {kept}")


def save_atomic(payload: dict, path: str | os.PathLike, kill: KillPoint | None = None) -> Path:
    """Write ``payload`` to ``path`` and its metadata beside it, so that ``path`` is absent, old, or complete.

    Cost: the SHA-256 as the bytes are written (about 1.5 GB/s on one core), one fsync of
    each file and of the directory. ``kill`` is the test-only fault hook (``faults``).
    Raises CheckpointSaveError naming the path (and, disk full, the free space).
    """
    path = Path(path)
    step = int(payload.get("step", -1)) if isinstance(payload.get("step", -1), int) else -1
    # the temporary lives in the same directory: os.replace is atomic only within a file system
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    writer = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            maybe_kill(kill, "ckpt_open", step)
            writer = _HashingWriter(f, kill, step)
            torch.save(payload, writer)  # type: ignore[arg-type]  # a file-like object: torch.save needs only write()
            f.flush()
            os.fsync(f.fileno())
        maybe_kill(kill, "ckpt_rename", step)
        # an older save of the same step loses its metadata first: until the new one is written,
        # the file counts as unfinished rather than as matching a checksum it no longer has
        meta_path(path).unlink(missing_ok=True)
        os.replace(tmp, path)
        maybe_kill(kill, "ckpt_meta", step)
        meta = {"format": FORMAT, "file": path.name, "step": step, "nbytes": writer.nbytes,
                "sha256": writer.sha256.hexdigest(), "run_id": payload.get("run_id"),  # run_identity.py
                "fence": payload.get("fence")}  # the job and generation that wrote it (fence.py)
        _write_durably(meta_path(path), (json.dumps(meta, indent=1) + "\n").encode())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        os_error = writer.error if writer is not None and writer.error is not None else e
        if isinstance(os_error, OSError):
            raise _save_error(path, os_error, writer.nbytes if writer else 0) from e
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the renames themselves durable
    finally:
        os.close(dir_fd)
    return path


def verify(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a good checkpoint (missing metadata, truncated, checksum mismatch), or None if it is.

    Reads the whole file once (SHA-256); unpickles nothing.
    """
    path, meta_file = Path(path), meta_path(path)
    if not meta_file.is_file():
        return f"{UNFINISHED}{meta_file.name} (its save never finished)"
    try:
        meta = json.loads(meta_file.read_text())
        expected_nbytes, expected_sha = int(meta["nbytes"]), str(meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its metadata {meta_file.name} is unreadable ({type(e).__name__}: {e})"
    if meta.get("format") != FORMAT:
        return f"its metadata {meta_file.name} is not {FORMAT!r}"
    try:
        nbytes = path.stat().st_size
        if nbytes != expected_nbytes:
            what = "zero-length file" if nbytes == 0 else "truncated" if nbytes < expected_nbytes else "too long"
            return f"{what}: {nbytes} bytes on disk, {expected_nbytes} written"
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
    except OSError as e:
        return f"unreadable ({e})"
    if sha.hexdigest() != expected_sha:
        return (
            f"checksum mismatch: SHA-256 {sha.hexdigest()[:16]}... on disk, {expected_sha[:16]}... written (corrupted)"
        )
    return None


def newest_good_checkpoint(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that passes ``verify``, and the newer ones skipped, each with why."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(directory)):
        why = verify(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def checkpoint_run_id(path: str | os.PathLike) -> str | None:
    """The run id in a checkpoint's metadata; None for a checkpoint written before run ids, or unreadable metadata."""
    try:
        run_id = json.loads(meta_path(path).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def prune_checkpoints(directory: str | os.PathLike, keep_last: int, run_id: str | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints of run ``run_id`` (and their metadata); returns them.

    Only that run's checkpoints are looked at (``run_id`` None: those without a run id): another
    run's files in the same folder are never deleted, and keep_last >= 1 keeps the run's newest.
    """
    if keep_last < 1:
        raise ValueError(f"prune_checkpoints: keep_last must be >= 1, got {keep_last}")
    found = [(step, path) for step, path in list_checkpoints(directory) if checkpoint_run_id(path) == run_id]
    doomed = [path for _, path in found[:-keep_last]]
    for path in doomed:
        path.unlink(missing_ok=True)
        meta_path(path).unlink(missing_ok=True)
        for part in path.parent.glob(f"{path.name.removesuffix('.pt')}.optim-r*-of-*"):  # ZeRO's (train/zero.py)
            part.unlink(missing_ok=True)
    return doomed


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint with ``weights_only=True`` and check it is one of ours (``verify`` checks the bytes)."""
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


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete ``.ckpt-*.tmp-<pid>`` files that writers killed mid-save left behind (call before training)."""
    directory = Path(directory)
    stale = sorted(directory.glob(".ckpt-*.tmp-*")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def probe_writable(directory: str | os.PathLike) -> None:
    """Create, write and delete a small file in ``directory``; raise CheckpointSaveError naming it if that fails.

    Asked of the file system rather than of ``os.access``, which says yes to root on a read-only mount.
    """
    directory = Path(directory)
    probe = directory / f".lockstep-write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"lockstep")
        probe.unlink()
    except OSError as e:
        raise CheckpointSaveError(
            e.errno, f"TrainerConfig.checkpoint_dir {directory} is not writable: {e.strerror or e} "
            f"({type(e).__name__}, checked by global rank 0 before training)") from e
