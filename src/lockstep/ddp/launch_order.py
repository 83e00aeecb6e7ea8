"""The launch sequences and the slow-link rule the reducer's launch order (``reducer.LaunchOrder``) follows.

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
