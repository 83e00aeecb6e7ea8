"""When a ready bucket may launch: in bucket-index order, the same on every rank.

Gradients become ready in an order that can differ between ranks (threads, timing),
but collectives must be issued in the same order everywhere or they pair up wrongly
and hang. So a bucket that is ready before an earlier one waits for it, and the end
of backward drains whatever is still held back. With a comm hook that may issue
further collectives from its futures' callbacks (torch's PowerSGD does, on gloo's
thread), at most one bucket is in flight: only one such hook at a time keeps their
order the same on every rank. Hooks that issue every collective from the call
itself (``lockstep.comm_hooks.issues_collectives_up_front``: the all-reduce and
fp16/bf16 hooks, ours and torch's, and chains of them) keep every bucket in flight,
as without a hook.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lockstep.ddp.reducer_state import Bucket


class LaunchOrder:
    """Launches ``buckets`` through ``launch`` in index order as they become ready; one per backward.

    ``one_in_flight``: a hook that may issue collectives from its callbacks is registered (the backward's plan).
    """

    __slots__ = ("_launch", "_one_in_flight", "buckets", "next_index", "ready")

    def __init__(self, buckets: Sequence[Bucket], launch: Callable[[Bucket], None], one_in_flight: bool):
        self.buckets = buckets
        self._launch = launch
        self._one_in_flight = one_in_flight
        self.ready = [False] * len(buckets)
        self.next_index = 0

    def mark_ready(self, index: int) -> None:
        """Bucket ``index`` holds all its gradients: launch it, and any later ones it was holding back."""
        self.ready[index] = True
        buckets, n = self.buckets, len(self.buckets)
        while self.next_index < n and self.ready[self.next_index]:
            if self.next_index > 0 and self._one_in_flight and not buckets[self.next_index - 1].work.done():
                break  # the previous hooked bucket is still in flight: drain() or a later ready bucket retries
            self._launch(buckets[self.next_index])
            self.next_index += 1

    def drain(self) -> None:
        """End of backward: launch every bucket still held back, each hooked one after the previous is done."""
        while self.next_index < len(self.buckets):
            if self.next_index > 0 and self._one_in_flight:
                self.buckets[self.next_index - 1].work.wait()
            self._launch(self.buckets[self.next_index])
            self.next_index += 1
