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
as without a hook. On a slow link (``Reducer.serial_launch``: below ``SERIAL_BELOW_BYTES_S`` measured) every
bucket waits for the previous one too: gloo runs two queued all-reduces at once, and through a shaped 100 Mbit/s
link four 10 MB all-reduces at once took 3668 ms against 3552 ms one after another (3501 ms as one buffer); at
1 Gbit/s the three were equal, at 2.5 Gbit/s and on loopback at once was faster (144 against 155 ms; 63 against
77 ms): benchmarks/link_wire.py, benchmarks/results/link-wire-2026-11-26.md.

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


# Below this measured rate (bytes of gradients per second from a backward's first launch to its last average back),
# buckets go one at a time: 500 Mbit/s, between the 100 Mbit/s link where that paid and the 1 Gbit/s one where it
# made no difference.
SERIAL_BELOW_BYTES_S = 62.5e6
# ... for gradients of at least this size: below it a loaded machine's waits (a rank that waits for a time slice) can
# read as a slow wire, and there one bucket at a time gains little anyway.
SERIAL_MIN_BYTES = 16 << 20


def wire_is_slow(nbytes: float, elapsed_s: float, waited_s: float) -> bool:
    """A backward's gradients (``nbytes``) crossed slower than ``SERIAL_BELOW_BYTES_S`` from its first launch to its
    last average back (``elapsed_s``: a lower bound on the wire's rate), and the wire set that end: most of the time
    went to waiting (``waited_s``), not to the backward."""
    return nbytes >= SERIAL_MIN_BYTES and 2 * waited_s > elapsed_s and nbytes < SERIAL_BELOW_BYTES_S * elapsed_s


def _done(work: object) -> bool:
    """A bucket's collective has finished: a ``dist.Work`` (``is_completed``) or a comm hook's Future (``done``)."""
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else bool(work.done())  # type: ignore[attr-defined]


class LaunchOrder:
    """Launches ``buckets`` through ``launch`` in ``sequence`` (default: index order) as they become ready; one per
    backward.

    ``one_in_flight``: a hook that may issue collectives from its callbacks is registered (the backward's plan), or
    the link is slow (``SERIAL_BELOW_BYTES_S``): each bucket launches once the previous one is done.
    """

    __slots__ = ("_launch", "_one_in_flight", "carrier_last_ready", "buckets", "next_index", "ready", "sequence",
                 "stop")

    def __init__(self, buckets: Sequence[Bucket], launch: Callable[[Bucket], None], one_in_flight: bool,
                 sequence: Sequence[int] | None = None, carrier_last_ready: bool = False):
        self.buckets = buckets
        self._launch = launch
        self._one_in_flight = one_in_flight
        # The last bucket (its spare element carries the non-finite verdict) waits until every bucket is ready, so
        # all can be checked before it goes (``overlap_step``'s sequence launches it ahead of others).
        self.carrier_last_ready = carrier_last_ready
        self.sequence = range(len(buckets)) if sequence is None else sequence
        self.ready = [False] * len(buckets)
        self.next_index = 0  # position in ``sequence`` of the next bucket to launch
        # Positions from here on wait for ``launch_next`` (the overlapped step feeds the wire from the next forward,
        # one bucket at a time, so gloo's two threads do not share the link between the first layers' bucket and
        # the next); by default none wait.
        self.stop = len(buckets)

    def mark_ready(self, index: int) -> None:
        """Bucket ``index`` holds all its gradients: launch it, and any later ones it was holding back."""
        self.ready[index] = True
        buckets, sequence, n = self.buckets, self.sequence, len(self.buckets)
        while self.next_index < min(n, self.stop) and self.ready[sequence[self.next_index]]:
            if self.next_index > 0 and self._one_in_flight and not _done(buckets[sequence[self.next_index - 1]].work):
                break  # the previous hooked bucket is still in flight: drain() or a later ready bucket retries
            if self.carrier_last_ready and sequence[self.next_index] == n - 1 and not all(self.ready):
                break  # the verdict's carrier goes once every bucket can be checked: a later ready one or drain()
            self._launch(buckets[sequence[self.next_index]])
            self.next_index += 1

    def drain(self) -> None:
        """End of backward: launch every bucket still held back, each hooked one after the previous is done."""
        sequence = self.sequence
        while self.next_index < min(len(self.buckets), self.stop):
            if self.next_index > 0 and self._one_in_flight:
                self.buckets[sequence[self.next_index - 1]].work.wait()
            self._launch(self.buckets[sequence[self.next_index]])
            self.next_index += 1

    def launch_next(self) -> bool:
        """Launch the next bucket held at ``stop`` (every one is ready: after drain()); False if none is left."""
        if self.next_index >= len(self.buckets):
            return False
        self.stop = max(self.stop, self.next_index + 1)
        self._launch(self.buckets[self.sequence[self.next_index]])
        self.next_index += 1
        return True

    def bytes_to_cross(self) -> int:
        """Bytes of the buckets not launched yet or not complete: what the end of backward still waits for."""
        launched = set(self.sequence[: self.next_index])
        return sum(b.plan.numel * b.plan.dtype.itemsize for b in self.buckets
                   if b.index not in launched or not _done(b.work))

    def launched(self, index: int) -> bool:
        """Bucket ``index`` has been launched this backward."""
        return index in self.sequence[: self.next_index]
