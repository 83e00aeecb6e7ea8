"""When bucket views let go of their idle buckets between steps (``Bucket.release``), and when that is not worth it.

With bucket views (lockstep's None, torch's True) the buckets are the gradients, one model's worth (G). After
``zero_grad()`` no ``.grad`` points into them, yet the next forward's activations would sit on top of them: on a
model whose step peaks at the forward's end (benchmarks/memory.py's transformer) that is G of the peak for nothing.
So at a synchronised forward's start each idle bucket is let go of, and its next backward's first gradient takes
a fresh buffer (issue #30).

What a fresh buffer costs depends on the allocator. On a GPU the caching allocator hands back the block the
bucket gave up, or the activations', at no cost: the buckets are always let go of there. On the CPU, memory that
glibc gave back to the kernel comes back as page faults on first touch, ~0.4 ms per MB: measured on a 10.5M
MLP (42 MB of buckets, activations of 3 MB) that was +13 ms a step (+14%), to save memory no step needed, since
its peak is the end of backward. So on the CPU the reducer watches what the forward itself allocates while the
buckets are let go of (the growth of the process's resident memory, two reads of /proc/self/statm per step,
~10 us each) and keeps letting go only while that growth is at least ``MIN_ACTIVATION_SHARE`` of the bytes let
go of: where a forward's activations are that large, the buckets would have sat under them. Below it twice in a
row (once may be a bucket whose last work gloo's thread freed late, during the forward), the buckets stay for the
rest of the run: a model's activations do not shrink step after step.
``release`` forces the policy (True: always, False: never, as torch's reducer); None is the above.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from lockstep.ddp.reducer_state import Bucket

# The forward's new resident memory, as a share of the bytes let go of, below which letting go stops (CPU).
MIN_ACTIVATION_SHARE = 1 / 8

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory now (None where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class IdleBuckets:
    """One reducer's policy for its idle buckets under bucket views; the reducer calls it at each synchronised
    forward's start (``at_forward_start``, which lets go) and at each backward's start (``at_backward_start``)."""

    def __init__(self, release: bool | None = None):
        self.release = release
        """True: let go at every forward; False: never (torch's behaviour); None: on a GPU always, on the CPU while
        the forward's activations are at least ``MIN_ACTIVATION_SHARE`` of the buckets let go of."""
        self.worth_it = True  # None's verdict on the CPU so far
        self._strikes = 0  # forwards in a row whose activations were below the share (CPU, policy None)
        self.released_bytes = 0  # at the last forward's start: what the judgement weighs the forward's memory against
        self._resident_after: int | None = None  # resident bytes right after letting go (CPU, policy None)

    def wanted(self, buckets: Sequence[Bucket]) -> bool:
        """Whether this forward's start should let go of idle buckets (the reducer then drops the last works)."""
        if not buckets or self.release is False:
            return False
        return self.release is True or self.worth_it or buckets[0].plan.device.type != "cpu"

    def at_forward_start(self, buckets: Sequence[Bucket]) -> None:
        self.released_bytes = sum(bucket.release() for bucket in buckets)
        if self.release is None and self.released_bytes and buckets[0].plan.device.type == "cpu":
            self._resident_after = resident_bytes()

    def at_backward_start(self) -> None:
        """The forward is done, its activations made: judge (policy None, CPU) whether letting go was worth it."""
        before, self._resident_after = self._resident_after, None
        if before is not None:
            now = resident_bytes()
            if now is not None and now - before < self.released_bytes * MIN_ACTIVATION_SHARE:
                self._strikes += 1
                self.worth_it = self._strikes < 2
            else:
                self._strikes = 0
