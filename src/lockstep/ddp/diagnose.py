"""The wrapper's side of the diagnostics: build the checks and the trace its arguments ask for, attach them.

``DDP(check_replicas_every=N, detect_nonfinite=True, trace_dir=DIR)`` and ``LOCKSTEP_TRACE=DIR`` end
here; the diagnostics themselves live in ``lockstep.diagnostics`` and know nothing of ``ddp``. Also the
profiler ranges: while a ``torch.profiler`` is active (the wrapper reads one flag per forward) lockstep's
phases appear as ``record_function`` ranges; when none is, no observer is attached for them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lockstep.ddp.config import DiagnosticsOptions
from lockstep.ddp.reducer import Reducer
from lockstep.diagnostics.checks import PeriodicReplicaCheck
from lockstep.diagnostics.nonfinite import NonfiniteCheck
from lockstep.diagnostics.ranges import ProfilerRanges

if TYPE_CHECKING:  # imported where a trace is asked for (it pulls in the clock and the timeline)
    from lockstep.diagnostics.trace import TraceRecorder

DEFAULT_TRACE_STEPS = (5, 10)


class DiagnosedDDP(Protocol):
    """The wrapper (``DistributedDataParallel``), as its diagnostics are built and attached: what is read and set."""

    @property
    def module(self) -> nn.Module: ...
    @property
    def process_group(self) -> dist.ProcessGroup: ...
    @property
    def reducer(self) -> Reducer: ...
    @property
    def parameters_to_ignore(self) -> set[str]: ...

    check_replicas_every: int | None
    detect_nonfinite: bool
    trace: TraceRecorder | None
    _replica_check: PeriodicReplicaCheck | None
    _profiler_ranges: ProfilerRanges | None
    _profiling: bool


def setup(ddp: DiagnosedDDP, options: DiagnosticsOptions, check_first: bool | None = None) -> None:
    """Called once at construction (and after unpickling, without the trace; and by ``rebind``, ``check_first``)."""
    check_replicas_every, trace_dir, trace_steps = options.check_replicas_every, options.trace_dir, options.trace_steps
    ddp.check_replicas_every, ddp.detect_nonfinite = check_replicas_every, options.detect_nonfinite
    # The one check at the first synchronised forward (``checks.FIRST_FORWARD_HINT``) is on wherever the
    # construction made the replicas equal (off with init_sync=False, as at world size 1), or where ``check_first``
    # says so: rebind's replicas must be equal already.
    wanted = getattr(ddp, "_init_sync", True) if check_first is None else check_first
    first = wanted and dist.get_world_size(ddp.process_group) > 1
    ddp._replica_check = None if check_replicas_every is None and not first else PeriodicReplicaCheck(
        check_replicas_every, ddp.module, ddp.process_group, first=first, ignored=ddp.parameters_to_ignore)
    attach_nonfinite(ddp)
    ddp._profiler_ranges, ddp._profiling = None, False
    ddp.trace = None
    trace_dir = trace_dir if trace_dir is not None else os.environ.get("LOCKSTEP_TRACE") or None
    if trace_dir is not None:
        from lockstep.diagnostics.trace import TraceRecorder, window_from_env

        steps = (
            trace_steps
            if trace_steps is not None
            else window_from_env(os.environ.get("LOCKSTEP_TRACE_STEPS"), DEFAULT_TRACE_STEPS)
        )
        recorder = TraceRecorder(ddp.reducer, ddp.process_group, trace_dir, steps, on_finish=lambda: _detach_trace(ddp))
        ddp.reducer.attach_observer(recorder)
        ddp.trace = recorder


def attach_nonfinite(ddp: DiagnosedDDP) -> None:
    """(Re)attach the non-finite check to the current reducer."""
    if ddp.detect_nonfinite:
        ddp.reducer.set_nonfinite(NonfiniteCheck(
            ddp.reducer.names, ddp.process_group, ddp.reducer.gradient_as_bucket_view
        ))


def _detach_trace(ddp: DiagnosedDDP) -> None:
    if ddp.trace is not None:
        ddp.reducer.detach_observer(ddp.trace)


def toggle_profiler_ranges(ddp: DiagnosedDDP, enabled: bool) -> None:
    """A torch.profiler started or stopped since the last forward: attach or detach the ranges observer."""
    if enabled and ddp._profiler_ranges is None and ddp.trace is None:  # a recording trace opens its own ranges
        ddp._profiler_ranges = ProfilerRanges()
        ddp.reducer.attach_observer(ddp._profiler_ranges)
    elif not enabled and ddp._profiler_ranges is not None:
        ddp._profiler_ranges.close_ranges()
        ddp.reducer.detach_observer(ddp._profiler_ranges)
        ddp._profiler_ranges = None
    ddp._profiling = enabled


def profiler_enabled() -> bool:
    return torch._C._autograd._profiler_enabled()
