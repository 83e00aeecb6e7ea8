"""When a ready bucket may launch: in one fixed sequence (bucket-index order by default), the same on every rank.

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

The overlapped optimizer step (``overlap_step``) launches in another fixed sequence: the buckets the wire can carry
during backward in index order, then the rest from the last (the model's first layers, which the next forward needs
first) back: ``priority_sequence``. Every rank uses the same sequence, agreed at a round boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lockstep.ddp.reducer_state import Bucket


def priority_sequence(num_buckets: int, sent_during_backward: int) -> list[int]:
    """Buckets ``0 .. sent_during_backward - 1`` in index order, then the rest from the last back to the first."""
    k = max(1, min(sent_during_backward, num_buckets))
    return list(range(k)) + list(range(num_buckets - 1, k - 1, -1))


class LaunchOrder:
    """Launches ``buckets`` through ``launch`` in ``sequence`` (default: index order) as they become ready; one per
    backward.

    ``one_in_flight``: a hook that may issue collectives from its callbacks is registered (the backward's plan).
    """

    __slots__ = ("_launch", "_one_in_flight", "buckets", "next_index", "ready", "sequence")

    def __init__(self, buckets: Sequence[Bucket], launch: Callable[[Bucket], None], one_in_flight: bool,
                 sequence: Sequence[int] | None = None):
        self.buckets = buckets
        self._launch = launch
        self._one_in_flight = one_in_flight
        self.sequence = range(len(buckets)) if sequence is None else sequence
        self.ready = [False] * len(buckets)
        self.next_index = 0  # position in ``sequence`` of the next bucket to launch

    def mark_ready(self, index: int) -> None:
        """Bucket ``index`` holds all its gradients: launch it, and any later ones it was holding back."""
        self.ready[index] = True
        buckets, sequence, n = self.buckets, self.sequence, len(self.buckets)
        while self.next_index < n and self.ready[sequence[self.next_index]]:
            if self.next_index > 0 and self._one_in_flight and not buckets[sequence[self.next_index - 1]].work.done():
                break  # the previous hooked bucket is still in flight: drain() or a later ready bucket retries
            self._launch(buckets[sequence[self.next_index]])
            self.next_index += 1

    def drain(self) -> None:
        """End of backward: launch every bucket still held back, each hooked one after the previous is done."""
        sequence = self.sequence
        while self.next_index < len(self.buckets):
            if self.next_index > 0 and self._one_in_flight:
                self.buckets[sequence[self.next_index - 1]].work.wait()
            self._launch(self.buckets[sequence[self.next_index]])
            self.next_index += 1
