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

Cost while recording: a ``perf_counter`` and a list append per event, a done-callback per bucket, and a
``torch.profiler.record_function`` range per phase while a profiler runs; outside the window each
event is one integer comparison, and after it the recorder detaches itself.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from lockstep.diagnostics.clock import default_store, offset_to_rank0_s
from lockstep.diagnostics.ranges import ProfilerRanges

_COUNTER = itertools.count()  # one per recorder built in this process: ranks build theirs in the same order
GATHER_TIMEOUT_S = 120.0


def window_from_env(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
    """``"5:10"`` -> (5, 10); None -> default."""
    if not text:
        return default
    try:
        first, last = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"LOCKSTEP_TRACE_STEPS must look like FIRST:LAST (e.g. 5:10), got {text!r}") from None
    return first, last


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

    def __init__(self, reducer: Any, group: dist.ProcessGroup, trace_dir: str | os.PathLike, steps: tuple[int, int] = (5, 10),
                 on_finish: Callable[[], None] | None = None, link: str | None = None, quiet: bool = False):
        first, last = steps
        if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last):
            raise ValueError(f"trace steps must be integers with 1 <= first <= last, got {steps!r}")
        super().__init__()
        self.reducer, self.group = reducer, group
        self.trace_dir = Path(trace_dir)
        self.first, self.last = first, last
        self.on_finish, self.quiet = on_finish, quiet
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.link = link
        ranks = dist.get_process_group_ranks(group)
        self.prefix = f"lockstep/trace/{next(_COUNTER)}/{ranks[0]}-{ranks[-1]}-{len(ranks)}"
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
            self.events.append({"name": "optimizer + data", "cat": "host", "step": step - 1, "start": after, "end": now, "args": {}})
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
            itemsize = fused.dtype.itemsize if fused is not None else self.reducer.buckets[bucket_index].flat.element_size()
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
        """After its wait returned: the callback's stamp (``now`` if it has not run yet: then the wait just ended it)."""
        entry = self._inflight.pop(b, None)
        if entry is not None:
            launch, numel, nbytes, done, seq = entry
            end = now if done is None else min(done, now)
            self._span(f"all-reduce bucket {b}", "comm", launch, end, bucket=b, numel=numel, nbytes=nbytes, seq=seq)

    # ------------------------------------------------------------------ writing
    def write(self) -> dict[str, Path]:
        """Close the window: every rank of the group calls it (at its next forward, or explicitly); rank 0 writes."""
        if self.finished:
            return self.paths
        self.finished, self.recording = True, False
        self.close_ranges()
        mine = {"rank": dist.get_rank(), "group_rank": self.rank, "offset_s": self.offset_s, "rtt_s": self.rtt_s,
                "events": [dict(e, start=e["start"] + self.offset_s, end=e["end"] + self.offset_s) for e in self.events]}
        self.store.set(f"{self.prefix}/events/{self.rank}", json.dumps(mine))
        if self.rank == 0:
            keys = [f"{self.prefix}/events/{r}" for r in range(self.world_size)]
            self.store.wait(keys, _timedelta(GATHER_TIMEOUT_S))
            per_rank = [json.loads(self.store.get(k)) for k in keys]
            from lockstep.diagnostics.timeline import write_outputs

            self.paths, self.summary = write_outputs(per_rank, self.trace_dir, self.world_size, self._link_name(), self.quiet)
        if self.on_finish is not None:
            self.on_finish()
        return self.paths

    def _link_name(self) -> str:
        if self.link:
            return self.link
        return "nvlink" if self.reducer.buckets and self.reducer.buckets[0].flat.device.type == "cuda" else "loopback"


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
