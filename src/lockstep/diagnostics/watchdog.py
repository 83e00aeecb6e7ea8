"""The hang watchdog: one thread per process that publishes this rank's progress on the rendezvous store
and, when a rank has been stuck inside a DDP step for longer than ``hang_timeout_s``, has every rank
write a hang report and end the job.

Out of band on purpose: a hung job's process group is the thing that hangs, so the watchdog talks
through its own client of the TCPStore that ``torch.distributed`` already runs for rendezvous (torchrun's
agent's, or rank 0's under ``lockstep launch`` and ``env://``). Cost on the training thread: none beyond the observer's
attribute writes (``progress``); the thread does one store ``set`` and one ``check`` per tick
(``tick_s``, at most 1 s). Protocol, under the key prefix ``lockstep/hang/<restart>/<group>/``:

  p<rank>     this rank's progress record, rewritten every tick (a heartbeat counter in it)
  alarm       the first stalled rank's reason; every watchdog polls for it
  s<rank>     on alarm: the rank's position, user code location and every thread's stack (faulthandler)
  done<rank>  the rank has written its report (the rank hosting the store waits for the others)

Then every rank leaves with ``os._exit(HANG_EXIT_CODE)``: the job ends within about
``hang_timeout_s + 2 * tick_s + 2 * grace_s + 1`` s of the stall (under 2 x ``hang_timeout_s`` from
4 s up), instead of gloo's or NCCL's 30-minute default. A rank that leaves a DDP step with an exception (a peer died and
the collective failed) writes the same kind of report at exit, naming the ranks that stopped beating, or
that exited and on what error (every rank notes in its last record that it is exiting, and why).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep import keys
from lockstep.diagnostics import report
from lockstep.diagnostics.progress import (
    DDP_PHASES,
    PROGRESS,
    Progress,
    current_collective,
    in_library_code,
    thread_frame,
    user_location,
)

HANG_EXIT_CODE = report.HANG_EXIT_CODE  # a hang report was written and the job was ended
DEFAULT_HANG_TIMEOUT_S = 300.0
TIMEOUT_ENV = keys.HANG_TIMEOUT_ENV  # the DDP's default, set by `lockstep launch --hang-timeout`
LOG_DIR_ENV = keys.LOG_DIR_ENV  # where reports go (`lockstep launch` points it at the job's log folder)
LAUNCHER_GONE_GRACE_S = 30.0  # after its launcher died, a worker that outlives SIGTERM this long is ended


class _FromEnv:
    def __repr__(self) -> str:
        return f"${TIMEOUT_ENV} or {DEFAULT_HANG_TIMEOUT_S:g}"


FROM_ENV: Any = _FromEnv()


def resolve_hang_timeout(value: Any) -> float | None:
    """``hang_timeout_s`` as given (``FROM_ENV``: $LOCKSTEP_HANG_TIMEOUT_S, else 300); None or 0 turns it off."""
    source = "hang_timeout_s"
    if value is FROM_ENV:
        raw = os.environ.get(TIMEOUT_ENV, "")
        if raw.strip() == "":
            return DEFAULT_HANG_TIMEOUT_S
        source, value = f"${TIMEOUT_ENV}", raw
        if raw.strip().lower() in ("none", "off"):
            return None
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"DistributedDataParallel: {source} must be a number of seconds, None or 0, got {value!r}"
        ) from None
    if value < 0 or value != value:
        raise ValueError(f"DistributedDataParallel: {source} must be >= 0 (0 or None: off), got {value!r}")
    return value or None


def report_folder(environ: Any, store: tuple[str, int] | None = None) -> str:
    """Where this job's reports go: a folder of its own, never one that another job on the machine overwrites.

    ``lockstep launch`` names the job's log folder ($LOCKSTEP_LOG_DIR). torchrun writes each worker's
    error file into its job's log folder (``<log dir>/<run id>_<random>/attempt_<n>/<local rank>/error.json``,
    a temporary folder without --log-dir): the reports go beside, in the attempt's folder. Otherwise (env://,
    SLURM, mpirun) a folder under the temporary directory named by the run id or the store's address and
    the job's launcher process."""
    if environ.get(LOG_DIR_ENV):
        return environ[LOG_DIR_ENV]
    error_file = environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file and os.path.isabs(error_file):
        return os.path.dirname(os.path.dirname(error_file))
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    key = run_id if run_id not in ("", "none") else (f"{store[0]}-{store[1]}" if store else "job")
    job = environ.get("SLURM_JOB_ID") or f"ppid{os.getppid()}"  # the ranks of one node share their launcher
    return os.path.join(tempfile.gettempdir(), "lockstep-reports", f"{key}-{job}")


def _tcp_store() -> tuple[str, int] | None:
    """Host and port of the default group's TCPStore; None when it is another kind (FileStore, HashStore)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


class Watchdog(threading.Thread):
    """See the module docstring. ``store`` is this thread's own client; ranks are global ranks."""

    def __init__(self, store: Any, rank: int, world_size: int, hang_timeout_s: float, progress: Progress = PROGRESS,
                 report_dir: str | None = None):
        super().__init__(name="lockstep-hang-watchdog", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.progress = progress
        self.report_dir = report_dir
        self.set_timeout(hang_timeout_s)
        self.beat = 0
        self.stopped = threading.Event()
        self.reporting = threading.Lock()
        self.report_started = False
        self.exit_note: dict[str, Any] | None = None  # in the last record: this process is exiting, on what error
        # Under torchrun or lockstep launch the parent is the agent; if it dies (kill -9) the worker is
        # reparented and would train on alone (torchrun never tells it): see launcher_gone().
        self.launcher_pid = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self.launcher_gone_at: float | None = None
        atexit.register(self._at_exit)

    def set_timeout(self, hang_timeout_s: float) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.tick_s = min(1.0, hang_timeout_s / 8)
        # Collecting the other ranks' stacks and letting them read ours: bounded so the job ends
        # within 2 x the timeout of the stall.
        self.grace_s = min(10.0, max(1.0, hang_timeout_s / 4))

    def stop(self) -> None:
        self.stopped.set()

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        try:
            # A first record at once: a peer that dies within its first tick (a short run, a crash in step 1)
            # must still have a beat that stops, or the failure report cannot tell who went silent.
            if dist.is_initialized():
                self.publish()
            while not self.stopped.wait(self.tick_s):
                if not dist.is_initialized():
                    return  # the group was destroyed: nothing more to watch
                if self.launcher_gone():
                    continue
                self.publish()
                if self.exit_note is not None:
                    continue  # exiting on its own error (or cleanly): that is its report, not a hang's exit code
                if self.store.check(["alarm"]):
                    self.report_and_exit(json.loads(self.store.get("alarm")))
                reason = self.stall_reason()
                if reason is not None:
                    self.raise_alarm(reason)
                    self.report_and_exit(json.loads(self.store.get("alarm")))
        except Exception:
            # The store went away: the job is ending, or (torchrun's store) the launcher died with it.
            while not self.stopped.wait(self.tick_s) and self.launcher_pid is not None:
                self.launcher_gone()
            return  # a watchdog must never break training

    def launcher_gone(self) -> bool:
        """The agent that started this worker has died: say so once and stop the worker as a preemption would
        (SIGTERM: a Trainer finishes its step and checkpoints), then end it if it is still there after the grace."""
        if self.launcher_pid is None or os.getppid() == self.launcher_pid:
            return False
        now = time.monotonic()
        if self.launcher_gone_at is None:
            self.launcher_gone_at = now
            print(f"lockstep: rank {self.rank}: its launcher (pid {self.launcher_pid}, the torchrun / lockstep launch "
                  "agent) is gone; stopping this worker (SIGTERM)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        elif now - self.launcher_gone_at > LAUNCHER_GONE_GRACE_S:
            os._exit(1)
        return True

    def publish(self) -> None:
        self.beat += 1
        record = self.progress.snapshot()
        record.update(beat=self.beat, wall=time.time())
        if self.exit_note is not None:
            record.update(self.exit_note)
        self.store.set(f"p{self.rank}", json.dumps(record))

    def raise_alarm(self, reason: str) -> None:
        """Every rank's watchdog reports and ends its process at its next tick; the first rank to call names the
        reason (a later one's stall is the same hang seen from elsewhere)."""
        if self.store.add("alarms", 1) == 1:
            self.store.set("alarm", json.dumps({"rank": self.rank, "reason": reason}))

    def wait_for_report(self) -> None:
        """Called after ``raise_alarm`` from another thread: this thread waits while the watchdog's thread writes this
        rank's report and ends the process (it sees the alarm within a tick); returns only if it did not in time."""
        time.sleep(self.tick_s + 3 * self.grace_s + 5)

    def stall_reason(self) -> str | None:
        p = self.progress
        stalled_s = time.monotonic() - p.since
        if p.phase_now() not in DDP_PHASES or stalled_s <= self.hang_timeout_s:
            return None
        if not in_library_code(thread_frame(p.thread_id)):
            return None  # an exception left the step: the phase is stale, the thread is back in user code
        return (
            f"rank {self.rank} waited {stalled_s:.1f} s (hang_timeout_s={self.hang_timeout_s:g}) "
            f"in {report.describe(p.snapshot())}"
        )

    # ------------------------------------------------------------- the report
    def own_info(self, frame: Any = None, stacks: str | None = None) -> dict[str, Any]:
        frame = frame or thread_frame(self.progress.thread_id)
        info = self.progress.snapshot()
        info.update(rank=self.rank, where=user_location(frame), collective=current_collective(frame),
                    stacks=stacks or _all_stacks(), beat=self.beat, wall=time.time())
        return info

    def report_and_exit(self, alarm: dict[str, Any]) -> None:
        self.report_started = True  # from here on, this thread ends the process (see _at_exit)
        try:
            with self.reporting:
                self.store.set(f"s{self.rank}", json.dumps(self.own_info()))
                infos = self.collect("s", deadline=time.monotonic() + self.grace_s)
                records = self.records()
                text = report.hang_report(alarm, infos, records, self.world_size, self.hang_timeout_s)
                path = self.write(text, "hang")
                if alarm["rank"] == self.rank:
                    print(text + f"\n(every rank's report: {os.path.dirname(path)})", file=sys.stderr, flush=True)
                else:  # the full report is printed once, by the rank that raised the alarm
                    print(f"lockstep: hang report of rank {self.rank} written to {path}: "
                          f"{report.diagnose(infos, records, self.world_size)}", file=sys.stderr, flush=True)
                self.store.set(f"done{self.rank}", "1")
                # Whoever hosts the store (rank 0 under `lockstep launch` and env://) must outlive the others'
                # reads: everyone waits for every answering rank's report, and rank 0 lingers a little longer.
                done = self.collect("done", deadline=time.monotonic() + self.grace_s, wanted=set(infos))
                if self.rank == 0 and len(done) > 1:
                    time.sleep(min(1.0, 5 * self.tick_s))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)

    def collect(self, prefix: str, deadline: float, wanted: set[int] | None = None) -> dict[int, Any]:
        wanted = set(range(self.world_size)) if wanted is None else wanted
        found: dict[int, Any] = {}
        while True:
            for r in sorted(wanted - set(found)):
                if self.store.check([f"{prefix}{r}"]):
                    found[r] = json.loads(self.store.get(f"{prefix}{r}"))
            if len(found) == len(wanted) or time.monotonic() > deadline:
                return found
            time.sleep(min(0.1, self.tick_s))

    def records(self) -> dict[int, Any]:
        return {r: json.loads(self.store.get(f"p{r}")) for r in range(self.world_size) if self.store.check([f"p{r}"])}

    def write(self, text: str, kind: str) -> str:
        folder = self.report_dir or report_folder(os.environ)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{kind}-report-rank{self.rank}.txt")
        with open(path, "w") as f:
            f.write(text)
        return path

    # ------------------------------------------------- leaving a step by an error
    def _at_exit(self) -> None:
        """At interpreter exit: finish a report under way, write one if the process leaves a DDP step by an
        error, then stop the thread. A daemon thread still inside a store call when the interpreter
        finalises aborts the process ("terminate called without an active exception"), hence the join."""
        if self.report_started:
            time.sleep(3 * self.grace_s + 5)  # the report's os._exit ends the process meanwhile
        try:
            error = getattr(sys, "last_value", None)  # an uncaught exception ends the main thread
            self._note_exit(error)
            # Only an exit on a failed collective (DDP's wait, or any torch.distributed error): a clean exit may
            # find the phase stale (a backward that reduced nothing, torch.autograd.grad), and an error of this
            # rank's own (a ValueError in forward) is its own report, where waiting to watch the peers' beats
            # would only keep them waiting for this rank's sockets to close.
            phase = self.progress.phase_now()
            failed = error is not None and (phase in ("wait", "outer") or isinstance(error, dist.DistError))
            if failed and self.is_alive() and not self.stopped.is_set() and phase in DDP_PHASES:
                self._report_failure()
        finally:
            self.stop()
            if self.is_alive() and threading.current_thread() is not self:
                self.join(timeout=5.0)

    def _note_exit(self, error: BaseException | None) -> None:
        """Tell the peers that this process is exiting, and on which error (None: a clean exit): a peer whose
        collective fails because of it then says so instead of "stopped responding" (one store write, at exit)."""
        text = None
        if error is not None:
            first = str(error).strip().splitlines()[:1]
            text = f"{type(error).__name__}: {first[0] if first else ''}"[:240]
        self.exit_note = {"exited": True, "error": text}
        if not self.is_alive():
            return  # the group was destroyed (the thread ended with it), or the watchdog never ran
        try:
            self.publish()
        except Exception:
            pass  # the store is gone (its host exited first): nothing to tell

    def _report_failure(self) -> None:
        """The process is exiting from inside a DDP step (a collective failed): say which peers stopped beating
        or exited (on what error, from their last record). None where every peer exited on this rank's error."""
        try:
            before = self.records()
            time.sleep(2.5 * self.tick_s)  # long enough for every live rank to beat again
            after = self.records()
            silent = sorted(r for r in after if r != self.rank and
                            (after[r].get("exited") or after[r]["beat"] == before.get(r, {}).get("beat")))
            mine = self.exit_note and self.exit_note["error"]
            if not silent or (mine and all(after[r].get("error") == mine for r in silent)):
                return  # every peer left on this rank's own error: each printed it, there is nothing to add
            # The training thread's stack is gone by now; the exception that ended it says where it was.
            tb = getattr(sys, "last_traceback", None)
            frame, stacks = None, None
            if tb is not None:
                stacks = "".join(traceback.format_exception(sys.last_type, sys.last_value, tb))
                while tb.tb_next is not None:
                    tb = tb.tb_next
                frame = tb.tb_frame
            with self.reporting:
                text = report.failure_report(self.rank, self.own_info(frame, stacks), after, silent, self.world_size)
                path = self.write(text, "failure")
            print(text + f"\n(written to {path})", file=sys.stderr, flush=True)
        except Exception:
            return


def _all_stacks() -> str:
    """Every thread's Python stack but the watchdog's own, as faulthandler prints it (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        blocks = f.read().split("\n\n")
    return "\n\n".join(b for b in blocks if not b.startswith("Current thread"))


_WATCHDOG: Watchdog | None = None
_WATCHDOG_KEY: tuple | None = None


def report_hang_now(reason: str) -> None:
    """A wait ended by a bound shorter than ``hang_timeout_s`` with no peer gone (in-place recovery's gloo timeout,
    ``LOCKSTEP_INPLACE_TIMEOUT_S``, while every rank still beats: one is stuck, not lost): raise the hang alarm now
    with ``reason``, so that every rank writes its hang report, the stuck one's line and stacks included, and the job
    ends with ``HANG_EXIT_CODE``, as after ``hang_timeout_s``. The watchdog's thread writes this rank's report and
    ends the process while the caller waits here. Returns only where no watchdog runs (``hang_timeout_s=0``, one
    rank, no TCPStore) or the report did not end the process in time: the caller then raises its own error."""
    dog = _WATCHDOG
    if dog is None or not dog.is_alive() or dog.exit_note is not None:
        return
    try:
        dog.raise_alarm(reason)
    except Exception:
        return  # the store is gone: nobody could collect the reports
    dog.wait_for_report()


def watch_for_hangs(process_group: Any, hang_timeout_s: float | None) -> bool:
    """Start (or retune) this process's watchdog for the default group's store; False when none runs.

    One watchdog per process, whatever the number of DDP models: progress is the process's. It needs a
    TCPStore (torchrun, ``lockstep launch``, ``env://``); with a FileStore or HashStore, or a single
    rank, there is no watchdog. Global ranks are used: the report speaks of the job's ranks.
    """
    global _WATCHDOG, _WATCHDOG_KEY
    if hang_timeout_s is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    address = _tcp_store()
    if address is None:
        return False
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = (*address, restart, id(dist.distributed_c10d._get_default_group()))
    if _WATCHDOG is not None and _WATCHDOG_KEY == key and _WATCHDOG.is_alive():
        _WATCHDOG.set_timeout(hang_timeout_s)  # the latest DDP's value
        return True
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        # replaced (a group re-formed in place): atexit's reference would keep it, and its store client, for good
        atexit.unregister(_WATCHDOG._at_exit)
    # Our own client (one socket): the group's client may be blocked in a get() of its own.
    try:
        client = dist.TCPStore(
            address[0], address[1], is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
        )
    except Exception as e:  # the watchdog must never stop training from starting
        warnings.warn(
            f"lockstep: no hang watchdog: cannot reach the rendezvous store at {address[0]}:{address[1]} ({e})",
            stacklevel=2,
        )
        return False
    group_tag = dist.distributed_c10d._get_default_group().group_name
    store = dist.PrefixStore(f"lockstep/hang/{restart}/{group_tag}/", client)
    _WATCHDOG = Watchdog(store, dist.get_rank(), dist.get_world_size(), hang_timeout_s,
                         report_dir=report_folder(os.environ, address))
    _WATCHDOG_KEY = key
    _WATCHDOG.start()
    return True
