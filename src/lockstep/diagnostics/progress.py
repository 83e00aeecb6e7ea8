"""Where this rank is in its training step, kept in memory by the training thread and read by the watchdog.

One ``Progress`` per process. The DDP reducer's observer events (``lockstep.ddp.observe``) and the
Trainer's ``set_phase`` calls write a few attributes and one ``time.monotonic()`` per event, never
the store: the watchdog thread reads this record and publishes it (``lockstep.diagnostics.watchdog``).
The observer takes neither the backward's start nor any per-bucket event (``all_events`` is False): at the
forward it notes the reducer, at the end of backward the buckets it waits for (``waiting``), and the watchdog's reads
(``phase_now``, ``snapshot``) find the rest from them: a backward runs while the reducer holds one (``step``), the
bucket launched last is the one with the highest ``seq`` among those holding a work, the one waited on is the first
whose work has not completed. A steady step's own cost is a few attribute writes per phase. Phases:

  data       between a backward's end and the next forward (a plain script's data loading, logging...)
  forward    inside DDP's forward (its buffer broadcast and the module's forward)
  loss       the forward returned, backward has not started
  backward   backward runs; buckets are launched as their gradients land
  wait       the end of backward waits for bucket ``bucket``'s all-reduce (collective ``seq``)
  outer      DiLoCo (``ddp.diloco``) waits for a bucket of its outer all-reduce across nodes, or for its broadcast
             inside the node (``outer``: the fragment, the bucket, the inner step it was launched after)
  optimizer, eval, checkpoint ...   set by the Trainer (``set_phase``)

Only forward / backward / wait / outer are DDP's own: a rank stalled in one of them for longer than the
hang timeout is hung in DDP. The watchdog also notices a training thread stuck in any
``torch.distributed`` collective of the user's own (see ``current_collective``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from lockstep.code_paths import is_framework_code, is_library_code

DDP_PHASES = ("forward", "backward", "wait", "outer")


class Progress:
    """The training thread's position. Written without a lock: each field is one attribute store (atomic
    under the GIL); a reader may see a new ``phase`` with the previous ``since`` at worst, for one tick."""

    def __init__(self) -> None:
        self.step_done = 0  # synchronised backwards completed (the reducer's count)
        self.phase = "data"
        self.bucket = -1  # bucket launched or waited on last (-1: none this step)
        self.seq = 0  # the reducer's collective sequence number of that bucket
        self.numel = 0  # elements of the last launched bucket
        self.since = time.monotonic()  # when the last event happened
        self.thread_id = threading.main_thread().ident
        self.skipped_backward: tuple[int, str] | None = None  # (step, where) of the first forward without backward
        self.op = "all-reduce"  # what the waits are for: ZeRO-2's "reduce-scatter" / "all-gather" (``collective``)
        self.before_wait = "backward"  # the phase a wait interrupted, restored at its end
        # Where the phase "backward", bucket and seq come from (``phase_now``, ``snapshot``): the reducer of the last
        # forward (a weak reference), and the buckets the end of backward waits for, in order.
        self.reducer: Callable[[], Any] | None = None
        self.waits: Sequence[Any] | None = None
        # DiLoCo's outer wait (phase "outer"): what it waits for, and the phase it interrupted, restored at its end
        self.outer: dict[str, Any] | None = None
        self.before_outer = "data"

    def set_phase(self, phase: str) -> None:
        self.phase, self.since = phase, time.monotonic()

    def phase_now(self) -> str:
        """``phase``, or "backward" once the reducer of the last forward holds a backward (its ``step``): no event
        says so, the watchdog's read does."""
        if self.phase == "loss" and self.reducer is not None and getattr(self.reducer(), "step", None) is not None:
            return "backward"
        return self.phase

    def snapshot(self) -> dict[str, Any]:
        bucket, seq, numel = self._bucket_now()
        return {"step_done": self.step_done, "phase": self.phase_now(), "bucket": bucket, "seq": seq,
                "numel": numel, "stalled_s": round(time.monotonic() - self.since, 3),
                "skipped_backward": self.skipped_backward, "op": self.op,
                "outer": self.outer if self.phase == "outer" else None}

    def _bucket_now(self) -> tuple[int, int, int]:
        """(bucket, seq, numel): the bucket waited on (the first of ``waits`` not complete), or in backward the one
        launched last; else what the last explicit event said. Read on the watchdog's thread: the reducer's buckets
        are read, never written, and a work's ``is_completed`` is safe from any thread."""
        phase, waits = self.phase_now(), self.waits
        buckets: Sequence[Any] = ()
        if phase == "wait" and waits is not None:
            buckets = ([b for b in waits if b.work is not None and not b.work.is_completed()][:1]
                       or _failed_wait(waits) or waits[-1:])
        elif phase == "backward" and self.reducer is not None:
            # a backward's start lets go of the last one's works: those holding one launched in this backward
            launched = [b for b in getattr(self.reducer(), "buckets", ()) if b.work is not None]
            if not launched:
                return -1, self.seq, 0
            buckets = [max(launched, key=lambda b: b.seq)]
        if buckets:
            b = buckets[0]
            return b.index, b.seq, b.flat.numel()
        return self.bucket, self.seq, self.numel


PROGRESS = Progress()


def _failed_wait(waits: Sequence[Any]) -> list[Any]:
    """Every work is complete, as a failed one is too: the bucket whose wait raised the error this process exits on
    (a local ``bucket`` of a frame in its traceback: dead frames, read safely), or none."""
    error = getattr(sys, "last_value", None)
    tb = getattr(error, "__traceback__", None)
    found: list[Any] = []
    while tb is not None:
        bucket = tb.tb_frame.f_locals.get("bucket")
        if any(bucket is b for b in waits):
            found = [bucket]  # the innermost one wins
        tb = tb.tb_next
    return found


def set_phase(phase: str) -> None:
    """Mark what the training thread does now (the Trainer: "data", "optimizer", "eval", "checkpoint")."""
    PROGRESS.set_phase(phase)


class ProgressObserver:
    """The reducer's observer that keeps ``PROGRESS`` current (duck-typed ``StepObserver``: ``diagnostics``
    sits below ``ddp`` and does not import it). ``owner()`` is the reducer (held weakly: a ``weakref.ref``, a C
    call) or None; its ``expect_hooks`` says whether it still waits for the backward of its last synchronised
    forward: true at a forward's start means that backward was skipped."""

    def __init__(self, owner: Callable[[], object | None], progress: Progress = PROGRESS):
        self.progress = progress
        self.owner = owner

    def forward_start(self) -> None:
        p = self.progress
        if p.skipped_backward is None and getattr(self.owner(), "expect_hooks", False):
            p.skipped_backward = (p.step_done + 1, user_location(sys._getframe(1)))  # once: a frame walk
        p.thread_id = threading.get_ident()
        p.phase, p.bucket, p.since, p.reducer, p.waits = "forward", -1, time.monotonic(), self.owner, None

    def forward_end(self) -> None:
        p = self.progress
        p.phase, p.since = "loss", time.monotonic()
        p.op = "all-reduce"  # the next forward's all-gathers (ZeRO-2) are waited for: named at the end of backward

    all_events = False  # the backward's start and the buckets are read from the reducer (``Progress.phase_now``)

    def backward_start(self) -> None:  # called only with another observer that takes every event (``all_events``)
        self.progress.phase, self.progress.since = "backward", time.monotonic()

    def waiting(self, buckets: Sequence[Any], op: str) -> None:
        p = self.progress
        p.phase, p.before_wait, p.waits, p.op, p.since = "wait", "backward", buckets, op, time.monotonic()

    def wait_start(self, bucket_index: int, seq: int) -> None:  # the next forward's waits (overlapped step, ZeRO-2)
        p = self.progress
        if p.phase != "wait":
            p.before_wait = p.phase
        p.phase, p.bucket, p.seq, p.waits, p.since = "wait", bucket_index, seq, None, time.monotonic()

    def wait_end(self, bucket_index: int, seq: int) -> None:
        self.progress.phase, self.progress.since = self.progress.before_wait, time.monotonic()

    def collective(self, kind: str) -> None:
        self.progress.op = kind

    def backward_end(self, step: int) -> None:
        p = self.progress
        p.step_done, p.phase, p.since, p.waits = step, "data", time.monotonic(), None

    def outer_wait(self, fragment: int, bucket: int, buckets: int, launched_at: int, inner_step: int, op: str) -> None:
        """DiLoCo blocks on ``bucket`` (1-based) of ``buckets`` of ``fragment``'s outer sync, launched after inner step
        ``launched_at``, waited for after ``inner_step``; ``op``: "all-reduce" (across nodes) or "broadcast" (inside
        the node). Said before each bucket's wait: a few attribute writes a bucket, every H inner steps."""
        p = self.progress
        if p.phase != "outer":
            p.before_outer = p.phase
        p.outer = {"fragment": fragment, "bucket": bucket, "buckets": buckets, "launched_at": launched_at,
                   "inner_step": inner_step, "op": op}
        p.thread_id = threading.get_ident()  # a DiLoCo around a plain module: no forward said it
        p.phase, p.since = "outer", time.monotonic()

    def outer_end(self) -> None:
        p = self.progress
        if p.phase == "outer":
            p.phase, p.outer, p.since = p.before_outer, None, time.monotonic()

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _ignore  # an event added to the seam later: not needed here


def _ignore(*args: Any) -> None: ...


def observer_for(reducer: Any) -> ProgressObserver:
    """A progress observer for ``reducer`` (held weakly: the reducer holds the observer)."""
    return ProgressObserver(weakref.ref(reducer))


# ------------------------------------------------------------------- where in the user's code
def _is_library(filename: str) -> bool:
    # A user's installed package (a model library) counts as the user's code here: the innermost frame
    # outside torch and lockstep is where the step was called from.
    return is_library_code(filename, installed_packages=False)


def user_location(frame: FrameType | None) -> str:
    """``train.py:57 in main``: the innermost frame of ``frame``'s stack outside torch, lockstep and the
    standard library (the innermost frame itself when all are library code)."""
    innermost = frame
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def thread_frame(thread_id: int | None) -> FrameType | None:
    return sys._current_frames().get(thread_id) if thread_id is not None else None


def current_collective(frame: FrameType | None) -> str | None:
    """The ``torch.distributed`` function (``all_reduce``, ``barrier``...) the stack is inside, if any:
    the outermost public one, which is the one the caller called."""
    name = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py") and not code.co_name.startswith("_"):
            name = code.co_name
        elif name is not None and not code.co_filename.endswith("c10d_logger.py"):
            break
        frame = frame.f_back
    return name


def in_library_code(frame: FrameType | None) -> bool:
    """True while some frame of the stack is torch's or lockstep's: the thread is still inside the DDP
    step its phase names, not back in the user's code after an exception left the phase behind."""
    while frame is not None:
        if is_framework_code(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False
