"""The seam through which diagnostics watch a DDP step: one observer, called at each phase boundary.

The reducer and the wrapper call ``observer.<event>(...)`` at fixed points of a step; with no
observer attached (the default) each point costs one attribute test. Diagnostics (the hang watchdog,
the timeline tracer, the replica and non-finite checks) subclass ``StepObserver`` and override what
they need; ``attach`` fans several out. Observers must not issue collectives on the DDP's group
(that would change the order of collectives between ranks) and should be cheap: they run on the
training thread inside backward.

Events, in order within one synchronised step:
  forward_start()                                  the wrapper's forward begins (before any collective)
  forward_end()                                    the module's forward returned
  backward_start()                                 the first gradient hook or output pre-hook of backward
  bucket_ready(bucket_index)                       the bucket's last gradient landed (copied into it)
  bucket_launch(bucket_index, numel, seq)          its all-reduce (or comm hook) is about to be issued;
                                                   seq counts the reducer's launches since it was built
  bucket_launched(bucket_index, seq)               issued (asynchronous: not yet done)
  waiting(buckets, op)                             the end of backward waits for these buckets, in this order,
                                                   for their op ("all-reduce", ZeRO-2's "reduce-scatter")
  wait_start(bucket_index, seq) / wait_end(...)    ... for this one
  backward_end(step)                               gradients are averaged and back in ``.grad``; step =
                                                   the number of synchronised backwards so far
  collective(kind)                                 ZeRO-2: the waits that follow are of "all-gather"s (of the
                                                   next forward), not all-reduces

``backward_start`` and the per-bucket events (``bucket_ready``, ``bucket_launch``, ``bucket_launched``, and the
end of backward's ``wait_start``/``wait_end``) go only to an observer whose ``all_events`` is true (the timeline
tracer's, the profiler's ranges). The hang watchdog's progress, on by default, takes ``waiting`` instead and reads
the backward's start and which bucket launched last or is waited on from the reducer when it publishes
(``diagnostics.progress``): a steady step then calls no observer inside backward but at its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Observer(Protocol):
    """What the reducer and the wrapper call: ``StepObserver``'s events (diagnostics, which sit below ``ddp``, match
    it without importing it)."""

    all_events: bool  # wants backward_start and the per-bucket events

    def forward_start(self) -> None: ...
    def forward_end(self) -> None: ...
    def backward_start(self) -> None: ...
    def bucket_ready(self, bucket_index: int) -> None: ...
    def bucket_launch(self, bucket_index: int, numel: int, seq: int) -> None: ...
    def bucket_launched(self, bucket_index: int, seq: int) -> None: ...
    def waiting(self, buckets: Sequence[Any], op: str) -> None: ...
    def wait_start(self, bucket_index: int, seq: int) -> None: ...
    def wait_end(self, bucket_index: int, seq: int) -> None: ...
    def backward_end(self, step: int) -> None: ...
    def collective(self, kind: str) -> None: ...


class StepObserver:
    """No-op base: override the events you need."""

    all_events = True

    def forward_start(self) -> None: ...
    def forward_end(self) -> None: ...
    def backward_start(self) -> None: ...
    def bucket_ready(self, bucket_index: int) -> None: ...
    def bucket_launch(self, bucket_index: int, numel: int, seq: int) -> None: ...
    def bucket_launched(self, bucket_index: int, seq: int) -> None: ...
    def waiting(self, buckets: Sequence[Any], op: str) -> None: ...
    def wait_start(self, bucket_index: int, seq: int) -> None: ...
    def wait_end(self, bucket_index: int, seq: int) -> None: ...
    def backward_end(self, step: int) -> None: ...
    def collective(self, kind: str) -> None: ...


class _FanOut(StepObserver):
    def __init__(self, observers: list[Observer]):
        self.observers = observers

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name == "observers":
            return object.__getattribute__(self, name)
        if name == "all_events":
            return any(getattr(o, name, True) for o in object.__getattribute__(self, "observers"))
        calls = [getattr(o, name) for o in object.__getattribute__(self, "observers")]

        def fan(*args: Any) -> None:
            for call in calls:
                call(*args)

        return fan


def attach(current: Observer | None, new: Observer) -> Observer:
    """``current`` and ``new`` together (either may be the only one)."""
    if current is None:
        return new
    if isinstance(current, _FanOut):
        return _FanOut([*current.observers, new])
    return _FanOut([current, new])


def detach(current: Observer | None, old: Observer) -> Observer | None:
    """``current`` without ``old``."""
    if current is old:
        return None
    if isinstance(current, _FanOut):
        rest = [o for o in current.observers if o is not old]
        return rest[0] if len(rest) == 1 else (_FanOut(rest) if rest else None)
    return current
