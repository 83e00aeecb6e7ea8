"""The run folder's fence: one job trains into a checkpoint folder, and a writer from a stale generation is refused.

A job claims ``checkpoint_dir`` before its first step by creating ``.lockstep-job/gen-<G>.json`` with
``O_CREAT | O_EXCL`` (the file system's one atomic test-and-set: of two claimers of generation G one wins),
G one above the highest there, holding who claimed it (the job's id, its workers' store, host, boot id, pid).
The claimer, global rank 0, touches that file every ``LEASE_BEAT_S``: the lease. A claim finds the highest
generation's holder and

* takes the next generation when the holder is this job (its workers restarted, its group re-formed in place:
  the writer after the change advances, so a job's generations strictly increase with its membership), when its
  lease is stale (no touch for ``LEASE_S``: a job that ended, or was killed with its node), or when its process is
  provably dead (same boot of this machine, its pid gone);
* otherwise refuses in one line naming the running job and its store (``JobFenceError``): a second job would train
  into the folder beside it. Where the holder's store does not answer and its lease is fresh, it waits up to
  ``LEASE_S`` for the lease to go stale first (a job killed on another machine a moment ago).

Before every checkpoint the writer checks that the highest generation is still its own; a writer whose
generation was passed (cut off from its job for longer than the lease, and a newer generation claimed) is
refused before it writes (``StaleGenerationError``): etcd's and ZooKeeper's fencing tokens, on the folder itself.
Every checkpoint's metadata carries the generation that wrote it.

Cost: a claim is a directory listing and one small file; the lease one ``utime`` a second on a thread of rank 0;
the check before a save one listing. Nothing here is a collective: the Trainer broadcasts the verdicts.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lockstep.keys import JOB_ENV
from lockstep.network import accepts

__all__ = ["FENCE_DIR", "JobFence", "JobFenceError", "StaleGenerationError", "job_id_from_env"]

FENCE_DIR = ".lockstep-job"
LEASE_BEAT_S = 1.0  # the writer touches its generation's file this often
LEASE_S = 10.0  # a lease untouched this long is stale: > in-place recovery (~2 s) and a loaded machine's pauses
KEEP_GENERATIONS = 8  # older generation files are removed by the claimer (only the highest decides anything)


class JobFenceError(RuntimeError):
    """Another job trains into this checkpoint folder: starting here would make it a second one."""


class StaleGenerationError(RuntimeError):
    """This writer's generation was passed by a newer claim: it must not write into the folder any more."""


def job_id_from_env() -> str | None:
    """The job's id: ``lockstep launch``'s (one per job, across its nodes, restarts and in-place changes), torchrun's
    ``--rdzv-id`` where it names one, else None (the Trainer makes one per fit)."""
    if os.environ.get(JOB_ENV):
        return os.environ[JOB_ENV]
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun:{run}" if run and run != "none" else None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc), "" where there is none: a pid reused later
    has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


@dataclass(frozen=True)
class Holder:
    """The highest generation's claim: what its file says, and how long ago its lease was touched."""

    generation: int
    job: str
    store: str
    host: str
    boot: str
    pid: int
    pid_start: str
    age_s: float

    def provably_dead(self) -> bool:
        """Its process ran on this boot of this machine and is gone (or its pid was reused)."""
        return bool(self.boot) and self.boot == _boot_id() and _pid_start(self.pid) != self.pid_start

    def describe(self) -> str:
        return (f"job {self.job} (generation {self.generation}, its workers' store {self.store}, writer pid "
                f"{self.pid} on {self.host}, lease touched {self.age_s:.1f} s ago)")


class JobFence:
    """One job's claim on ``directory``: ``claim`` (or ``advance`` after a membership change), ``check`` before
    each write, ``release`` at the end. Only the writer (global rank 0) calls them."""

    def __init__(self, directory: str | os.PathLike, job: str):
        self.directory, self.job = Path(directory), job
        self.folder = self.directory / FENCE_DIR
        self.generation: int | None = None  # the generation this process holds
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- what the folder says -----------------------------------------------------------------
    def _path(self, generation: int) -> Path:
        return self.folder / f"gen-{generation:06d}.json"

    def _generations(self) -> list[int]:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        return sorted(int(n[4:10]) for n in names if n.startswith("gen-") and n.endswith(".json") and n[4:10].isdigit())

    def holder(self) -> Holder | None:
        """The highest generation's holder; None in a folder no job claimed."""
        for generation in reversed(self._generations()):
            path = self._path(generation)
            try:
                info = json.loads(path.read_text() or "{}")
                age_s = time.time() - path.stat().st_mtime
            except (OSError, ValueError):
                continue  # removed meanwhile, or a claim being written: the one below decides
            if not info:
                return Holder(generation, "?", "?", "?", "", 0, "", 0.0)  # being written this instant
            return Holder(generation, info["job"], info["store"], info["host"], info["boot"], info["pid"],
                          info["pid_start"], age_s)
        return None

    # -- claiming -----------------------------------------------------------------------------
    def claim(self, store: str) -> int:
        """Take the next generation for this job, or raise JobFenceError while another job holds the folder."""
        deadline = None
        while True:
            held = self.holder()
            if held is not None and held.job != self.job and held.age_s < LEASE_S and not held.provably_dead():
                if _answers(held.store):
                    raise JobFenceError(self._refusal(held, "its store answers"))
                deadline = deadline or time.monotonic() + LEASE_S
                if time.monotonic() > deadline:
                    raise JobFenceError(self._refusal(held, f"its lease is renewed but its store does not answer "
                                                            f"(waited {LEASE_S:.0f} s)"))
                time.sleep(0.5)
                continue
            if self._take((held.generation if held else 0) + 1, store):
                return self.generation  # type: ignore[return-value]

    def advance(self, store: str) -> bool:
        """After a membership change in place: the job's writer now takes the next generation (the old writer may
        be gone or cut off: either way it must not write any more). False, and nothing taken, if another job holds
        the folder (the next ``check`` refuses this writer)."""
        while True:
            held = self.holder()
            if held is not None and held.job != self.job:
                self.generation = -1  # passed: ``check`` says so before the next write
                return False
            if self._take((held.generation if held else 0) + 1, store):
                return True

    def _take(self, generation: int, store: str) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self._path(generation), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False  # another claimer took it first: look again
        info = {"job": self.job, "store": store, "host": socket.gethostname(), "boot": _boot_id(),
                "pid": os.getpid(), "pid_start": _pid_start(os.getpid()), "claimed_at": time.time()}
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(info) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.generation = generation
        for old in self._generations():
            if old < generation - KEEP_GENERATIONS:
                self._path(old).unlink(missing_ok=True)
        self._start_beat()
        return True

    def _refusal(self, held: Holder, why: str) -> str:
        return (f"checkpoint_dir {self.directory} is being trained into by {held.describe()}; {why}: starting here "
                f"would be a second job writing into it. Join that job (start this node with its launcher's "
                f"--master-addr), wait for it to end, or give this run another checkpoint_dir")

    # -- while the job trains -----------------------------------------------------------------
    def check(self, step: int) -> None:
        """Before writing step ``step``'s checkpoint: raise StaleGenerationError unless this writer's generation
        is still the folder's highest."""
        held = self.holder()
        if self.generation is not None and self.generation > 0 and held is not None \
                and held.generation == self.generation and held.job == self.job:
            return
        now = held.describe() if held is not None else "nobody (the fence's files were removed)"
        raise StaleGenerationError(
            f"checkpoint_dir {self.directory}: this writer (job {self.job}, generation {self.generation}) was "
            f"passed: the folder is now held by {now}; refusing to write the checkpoint of step {step}")

    def _start_beat(self) -> None:
        if self._beat is None or not self._beat.is_alive():
            self._stop.clear()
            self._beat = threading.Thread(target=self._touch, name="lockstep-job-lease", daemon=True)
            self._beat.start()

    def _touch(self) -> None:
        while not self._stop.wait(LEASE_BEAT_S):
            generation = self.generation
            if generation is None or generation <= 0:
                continue
            try:
                os.utime(self._path(generation))
            except OSError:
                pass  # removed (passed and pruned, or the folder wiped): ``check`` decides before the next write

    def release(self) -> None:
        """The job ended (or stopped for a requeue): its lease goes stale at once, so a resume need not wait."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2 * LEASE_BEAT_S)
        if self.generation is not None and self.generation > 0:
            try:
                os.utime(self._path(self.generation), (0, 0))
            except OSError:
                pass


def _answers(store: str) -> bool:
    host, _, port = store.rpartition(":")
    try:
        return bool(host) and accepts(host, int(port), 2.0)
    except ValueError:
        return False
