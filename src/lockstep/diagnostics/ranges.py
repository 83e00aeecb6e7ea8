"""Lockstep's phases as ``torch.profiler.record_function`` ranges, so a user's own profiler trace shows them.

Forward, backward, each bucket's launch (named with its size) and the end-of-backward wait appear as
``lockstep/*`` ranges next to torch's own ops. The wrapper attaches ``ProfilerRanges`` only while a
profiler is active (one flag read per forward) or a trace is recording, so they cost nothing otherwise.
"""

from __future__ import annotations

from typing import Any

import torch


class ProfilerRanges:
    """A step observer that opens and closes ``record_function`` ranges at the phase boundaries."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}

    def range_start(self, key: str, name: str) -> None:
        if not torch._C._autograd._profiler_enabled():
            return  # no profiler running: a range would be recorded nowhere
        self.range_end(key)
        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        self._open[key] = rf

    def range_end(self, key: str) -> None:
        rf = self._open.pop(key, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def close_ranges(self) -> None:
        for key in list(self._open):
            self.range_end(key)

    # The observer events (lockstep.ddp.observe.StepObserver's, duck-typed: diagnostics never import ddp).
    all_events = True

    def waiting(self, buckets: Any, op: str) -> None: ...

    def forward_start(self) -> None:
        self.range_start("forward", "lockstep/forward")

    def forward_end(self) -> None:
        self.range_end("forward")

    def backward_start(self) -> None:
        self.range_start("backward", "lockstep/backward")

    def bucket_ready(self, bucket_index: int) -> None: ...

    def bucket_launch(self, bucket_index: int, numel: int, seq: int) -> None:
        self.range_start(f"bucket{bucket_index}", f"lockstep/bucket{bucket_index} launch ({numel} elements)")

    def bucket_launched(self, bucket_index: int, seq: int) -> None:
        self.range_end(f"bucket{bucket_index}")

    def wait_start(self, bucket_index: int, seq: int) -> None:
        if "backward" in self._open:
            self.range_end("backward")
            self.range_start("wait", "lockstep/wait for all-reduce")

    def wait_end(self, bucket_index: int, seq: int) -> None: ...

    def backward_end(self, step: int) -> None:
        self.close_ranges()

    def collective(self, kind: str) -> None: ...
