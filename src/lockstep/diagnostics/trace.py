"""The overlap timeline recorder: what each rank did, when, for a window of steps, written as one Chrome trace.

``DDP(trace_dir=DIR)`` (or ``LOCKSTEP_TRACE=DIR``) attaches a ``TraceRecorder`` to the reducer's
observer seam. For the synchronised steps ``first..last`` (1-based, default 5..10) it keeps per rank:
forward, backward (until the end-of-backward wait), that wait, each bucket's ready instant and its
all-reduce from launch to done, and the gap to the next forward (optimizer and data; the Trainer marks
the two apart). When the window closes, each rank puts its events into the store, and rank 0 writes
``trace.json`` (Chrome trace format: Perfetto and chrome://tracing open it) with every rank on rank 0's
clock (``clock``), ``summary.json`` and ``timeline.png`` (``timeline``), and prints the summary.

A bucket's "done" is stamped by a done-callback on its work's future (it runs on gloo's or NCCL's
thread when the collective completes and only writes a float into a list); the exposed communication
is the end-of-backward wait, timed on the training thread. The callbacks are registered only inside
the window and have all run before its backward ends, so none is left for interpreter exit (see
``ddp/lifetime.py`` on what gloo's thread must not do then).

A window that the run never closes (it ends at or before the window's last step) is written when the
run ends: at ``lockstep.shutdown()``, at interpreter exit (``atexit``), or on the way out of a failure (a
shutdown or exit with an exception in flight waits only ``FAILURE_GATHER_TIMEOUT_S`` for the other ranks,
and the trace says which ranks it lacks). A window that never opened writes nothing and says so in one
line on rank 0, naming LOCKSTEP_TRACE_STEPS and the steps the run took. Open recorders are held weakly:
a DDP object dropped (and collected) before the run ends takes its unwritten window with it.

Cost while recording: a ``perf_counter`` and a list append per event, a done-callback per bucket, and a
``torch.profiler.record_function`` range per phase while a profiler runs; outside the window each
event is one integer comparison, and after it the recorder detaches itself.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.diagnostics.clock import default_store, offset_to_rank0_s
from lockstep.diagnostics.ranges import ProfilerRanges

_COUNTER = itertools.count()  # one per recorder built in this process: ranks build theirs in the same order
GATHER_TIMEOUT_S = 120.0
# At shutdown or exit with an exception in flight, a peer may be stuck in a collective and never hand in its
# events: rank 0 writes what it has after this long rather than hold the failure's exit back.
FAILURE_GATHER_TIMEOUT_S = 10.0
# Recorders whose window is not written yet, by creation order (every rank closes them in the same order).
_OPEN: weakref.WeakValueDictionary[int, TraceRecorder] = weakref.WeakValueDictionary()
_hooks_installed = False


def window_from_env(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
    """``"5:10"`` -> (5, 10); None -> default."""
    if not text:
        return default
    try:
        first, last = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"LOCKSTEP_TRACE_STEPS must look like FIRST:LAST (e.g. 5:10), got {text!r}") from None
    return first, last


class TracedBucket(Protocol):
    """What the recorder reads of one of the reducer's buckets (``ddp.reducer_state.Bucket``)."""

    @property
    def flat(self) -> torch.Tensor: ...
    @property
    def work(self) -> Any: ...  # the launch's dist.Work, or the Future a comm hook returned


class OnTheWireDtype(Protocol):
    """A compress hook the reducer runs itself (``ddp.fused_compress.FusedCompression``): its wire dtype."""

    @property
    def dtype(self) -> torch.dtype: ...


class TracedReducer(Protocol):
    """What the recorder reads of the DDP's reducer (``ddp.reducer.Reducer``); diagnostics/ does not import ddp/."""

    @property
    def num_syncs(self) -> int: ...
    @property
    def buckets(self) -> Sequence[TracedBucket]: ...
    def _fused_now(self) -> OnTheWireDtype | None: ...


class TraceRecorder(ProfilerRanges):
    """A step observer (see ``lockstep.ddp.observe``) recording a window of synchronised steps on this rank.

    Args:
        reducer: the DDP's reducer (read: ``num_syncs``, ``buckets[i].work`` / ``.flat``, ``_fused_now()``).
        group: the DDP's process group.
        trace_dir: where rank 0 writes trace.json, summary.json and timeline.png.
        steps: (first, last) synchronised steps to record, 1-based, inclusive.
        on_finish: called once the window is written (the wrapper detaches the recorder there).
        link: the cost-model link the summary prices the all-reduces with (default: loopback on CPU, nvlink on CUDA).
    """

    def __init__(self, reducer: TracedReducer, group: dist.ProcessGroup, trace_dir: str | os.PathLike,
                 steps: tuple[int, int] = (5, 10), on_finish: Callable[[], None] | None = None,
                 link: str | None = None, quiet: bool = False):
        first, last = steps
        if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last):
            raise ValueError(f"trace steps must be integers with 1 <= first <= last, got {steps!r}")
        super().__init__()
        self.reducer, self.group = reducer, group
        self.trace_dir = Path(trace_dir)
        self.first, self.last = first, last
        self.on_finish, self.quiet = on_finish, quiet
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.global_rank = dist.get_rank()  # kept: at exit the group may be gone
        self.link = link
        ranks = dist.get_process_group_ranks(group)
        self.index = next(_COUNTER)
        self.prefix = f"lockstep/trace/{self.index}/{ranks[0]}-{ranks[-1]}-{len(ranks)}"
        self.store = default_store(group)
        self.offset_s, self.rtt_s = offset_to_rank0_s(self.store, self.prefix, self.rank, self.world_size)
        self.events: list[dict] = []
        self.recording = False
        self.finished = False
        self.paths: dict[str, Path] = {}
        self.summary: dict | None = None
        self._step = 0
        self._inflight: dict[int, list] = {}  # bucket -> [launch time, numel, nbytes, done time or None, seq]
        self._t: dict[str, float] = {}
        self._marks_since_backward = False
        _OPEN[self.index] = self
        _install_hooks()

    # ------------------------------------------------------------------ recording
    def _span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        self.events.append({"name": name, "cat": cat, "step": self._step, "start": start, "end": end, "args": args})

    def mark(self, name: str, start: float, end: float) -> None:
        """A phase the caller timed (``time.perf_counter``): the Trainer marks "data" and "optimizer"."""
        if self.recording or (self.first <= self.reducer.num_syncs <= self.last and not self.finished):
            step = self._step if self.recording else self.reducer.num_syncs
            self.events.append({"name": name, "cat": "host", "step": step, "start": start, "end": end, "args": {}})
            self._marks_since_backward = True

    def forward_start(self) -> None:
        now = time.perf_counter()
        step = self.reducer.num_syncs + 1
        if self.finished:
            return
        after = self._t.pop("backward_end", None)
        if after is not None and not self._marks_since_backward and self.first <= step - 1 <= self.last:
            self.events.append({"name": "optimizer + data", "cat": "host", "step": step - 1, "start": after, "end": now,
                                "args": {}})
        if step > self.last:
            self.recording = False
            self.write()
            return
        self.recording = self.first <= step
        if self.recording:
            self._step = step
            self._t["forward"] = now
            self.range_start("forward", "lockstep/forward")

    def forward_end(self) -> None:
        if self.recording and "forward" in self._t:
            self._span("forward", "compute", self._t.pop("forward"), time.perf_counter())
            self.range_end("forward")

    def backward_start(self) -> None:
        if self.recording:
            self._t["backward"] = time.perf_counter()
            self.range_start("backward", "lockstep/backward")

    def bucket_ready(self, bucket_index: int) -> None:
        if self.recording:
            now = time.perf_counter()
            self.events.append({"name": f"bucket {bucket_index} ready", "cat": "ready", "step": self._step,
                                "start": now, "end": now, "args": {"bucket": bucket_index}})

    def bucket_launch(self, bucket_index: int, numel: int, seq: int) -> None:
        if self.recording:
            now = time.perf_counter()
            # The bytes on the wire: a compress hook the reducer runs itself (``ddp.fused_compress``) sends
            # half; a called hook's are its own business, counted at the bucket's size.
            fused = self.reducer._fused_now()
            if fused is not None:
                itemsize = fused.dtype.itemsize
            else:
                itemsize = self.reducer.buckets[bucket_index].flat.element_size()
            nbytes = numel * itemsize
            self._inflight[bucket_index] = [now, numel, nbytes, None, seq]
            self.range_start(f"bucket{bucket_index}", f"lockstep/bucket{bucket_index} launch ({nbytes} bytes)")

    def bucket_launched(self, bucket_index: int, seq: int) -> None:
        if self.recording and bucket_index in self._inflight:
            work = self.reducer.buckets[bucket_index].work
            future = work.get_future() if hasattr(work, "get_future") else work  # a comm hook returns the future
            entry = self._inflight[bucket_index]
            # Runs on the backend's thread at completion: one float into this step's list, nothing else.
            future.add_done_callback(lambda _f, entry=entry: entry.__setitem__(3, time.perf_counter()))
            self.range_end(f"bucket{bucket_index}")

    def wait_start(self, bucket_index: int, seq: int) -> None:
        if self.recording:
            now = time.perf_counter()
            if "backward" in self._t:  # the first wait: backward's own computation ended here
                self._span("backward", "compute", self._t.pop("backward"), now)
                self.range_end("backward")
                self._t["wait"] = now
                self.range_start("wait", "lockstep/wait for all-reduce")
            self._t["wait_bucket"] = now

    def wait_end(self, bucket_index: int, seq: int) -> None:
        if self.recording:
            now = time.perf_counter()
            start = self._t.pop("wait_bucket", now)
            if now - start > 20e-6:
                self._span(f"wait bucket {bucket_index}", "wait", start, now, bucket=bucket_index)
            self._finish_bucket(bucket_index, now)

    def backward_end(self, step: int) -> None:
        if not self.recording:
            return
        now = time.perf_counter()
        if "wait" in self._t:
            self._span("end-of-backward wait", "wait", self._t.pop("wait"), now)
            self.range_end("wait")
        for b in list(self._inflight):
            self._finish_bucket(b, now)
        self._t["backward_end"] = now
        self._marks_since_backward = False

    def _finish_bucket(self, b: int, now: float) -> None:
        """After its wait returned: the callback's stamp (``now`` if it has not run yet: then the wait just ended
        it)."""
        entry = self._inflight.pop(b, None)
        if entry is not None:
            launch, numel, nbytes, done, seq = entry
            end = now if done is None else min(done, now)
            self._span(f"all-reduce bucket {b}", "comm", launch, end, bucket=b, numel=numel, nbytes=nbytes, seq=seq)

    # ------------------------------------------------------------------ writing
    def write(self, closed_by: str | None = None, gather_timeout_s: float = GATHER_TIMEOUT_S,
              wait_for_rank0: bool = False) -> dict[str, Path]:
        """Close the window: every rank of the group calls it; rank 0 gathers the events through the store and writes.

        Called at the first forward after the window, by the Trainer at the end of ``fit``, and by
        ``close_open_traces`` when the run ends first (``closed_by`` names when: "lockstep.shutdown()",
        "exit", with "on failure" added when an exception is in flight). Rank 0 waits at most
        ``gather_timeout_s`` for the others and writes the ranks it has, naming the missing ones. With
        ``wait_for_rank0`` (on failure) the other ranks stay until rank 0 has written, at most as long:
        the launcher stops every rank once one exits with an error, rank 0 in the middle of writing too.
        """
        if self.finished:
            return self.paths
        self.finished, self.recording = True, False
        _OPEN.pop(self.index, None)
        self.close_ranges()
        steps_run = self.reducer.num_syncs
        mine = {"rank": self.global_rank, "group_rank": self.rank, "offset_s": self.offset_s, "rtt_s": self.rtt_s,
                "events": [dict(e, start=e["start"] + self.offset_s, end=e["end"] + self.offset_s)
                           for e in self.events]}
        try:
            if self.rank != 0:
                self.store.set(f"{self.prefix}/events/{self.rank}", json.dumps(mine))
                if wait_for_rank0:
                    try:
                        self.store.wait([f"{self.prefix}/written"], _timedelta(gather_timeout_s))
                    except Exception:  # rank 0 is stuck or gone: our exit must not wait longer
                        pass
            elif not self.events:  # the window never opened: nothing to gather, one line to say so
                _say(f"nothing written to {self.trace_dir}: the run ended after {steps_run} synchronised step(s), "
                     f"before the trace window {self.first}:{self.last} opened (LOCKSTEP_TRACE_STEPS or trace_steps; "
                     f"steps count from 1)")
            else:
                per_rank, missing = self._gather(mine, gather_timeout_s)
                recorded = sorted({e["step"] for e in self.events})
                window = {"requested": [self.first, self.last], "recorded": [recorded[0], recorded[-1]],
                          "missing_ranks": missing,
                          "closed_by": closed_by or ("the first forward after it" if recorded[-1] >= self.last
                                                     else "write()")}
                from lockstep.diagnostics.timeline import write_outputs

                self.paths, self.summary = write_outputs(per_rank, self.trace_dir, self.world_size, self._link_name(),
                                                         self.quiet, window=window)
                if recorded[-1] < self.last or missing:
                    _say(_window_note(window, steps_run, self.trace_dir))
        finally:
            if self.rank == 0:
                try:
                    self.store.set(f"{self.prefix}/written", "1")  # the ranks waiting on failure may go
                except Exception:
                    pass
            if self.on_finish is not None:
                self.on_finish()
        return self.paths

    def _gather(self, mine: dict, timeout_s: float) -> tuple[list[dict], list[int]]:
        """Rank 0: every rank's events, in rank order, waiting at most ``timeout_s``; and the ranks that never came."""
        keys = {r: f"{self.prefix}/events/{r}" for r in range(1, self.world_size)}
        if keys:
            try:
                self.store.wait(list(keys.values()), _timedelta(timeout_s))
            except Exception:  # DistStoreError on timeout: write the ranks that did hand theirs in
                pass
        per_rank: list[dict] = [mine]
        missing: list[int] = []
        for r, key in keys.items():
            try:
                got = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                got = None
            if got is None:
                missing.append(r)
            else:
                per_rank.append(got)
        return per_rank, missing

    def _link_name(self) -> str:
        if self.link:
            return self.link
        return "nvlink" if self.reducer.buckets and self.reducer.buckets[0].flat.device.type == "cuda" else "loopback"


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _say(text: str) -> None:
    print(f"lockstep trace: {text}", file=sys.stderr, flush=True)


def _window_note(window: dict, steps_run: int, trace_dir: Path) -> str:
    first, last = window["requested"]
    lo, hi = window["recorded"]
    parts = []
    if hi < last:
        parts.append(f"the run ended after {steps_run} synchronised step(s), inside the window {first}:{last} "
                     f"(LOCKSTEP_TRACE_STEPS or trace_steps): steps {lo}..{hi} written at {window['closed_by']}")
    if window["missing_ranks"]:
        parts.append(f"ranks {window['missing_ranks']} did not hand in their events in time (failed or stuck?): "
                     f"the trace in {trace_dir} lacks them")
    return "; ".join(parts)


def close_open_traces(closed_by: str, failing: bool) -> None:
    """Write every window this process has not written yet (each rank calls it at shutdown and at exit).

    Never raises: it runs in ``lockstep.shutdown()`` and ``atexit``, where an error would hide the run's own.
    """
    timeout_s = FAILURE_GATHER_TIMEOUT_S if failing else GATHER_TIMEOUT_S
    label = f"{closed_by} on failure" if failing else closed_by
    for index in sorted(_OPEN.keys()):
        recorder = _OPEN.get(index)
        if recorder is None or recorder.finished:
            continue
        try:
            recorder.write(label, timeout_s, wait_for_rank0=failing)
        except Exception as e:  # the store is gone (rank 0 ended first), the directory is not writable...
            _say(f"could not write the trace to {recorder.trace_dir} at {label}: {type(e).__name__}: {e}")


def _close_at_shutdown() -> None:
    close_open_traces("lockstep.shutdown()", failing=sys.exc_info()[1] is not None)  # called in a `finally`


def _close_at_exit() -> None:
    # An uncaught exception is printed (and stored in sys.last_value) before atexit runs.
    close_open_traces("exit", failing=getattr(sys, "last_value", None) is not None)


def _install_hooks() -> None:
    """Once per process: write open windows at ``lockstep.shutdown()`` and at interpreter exit."""
    global _hooks_installed
    if _hooks_installed:
        return
    from lockstep.process_group import on_shutdown

    on_shutdown(_close_at_shutdown)
    atexit.register(_close_at_exit)
    _hooks_installed = True
