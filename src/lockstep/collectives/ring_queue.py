"""The ring's reduce-scatter and all-gather run asynchronously: queued to one thread, in launch order, on a group of
their own.

ZeRO-2 launches a bucket's reduce-scatter during backward and waits for it at the end, and from ``opt.step()`` an
all-gather per bucket that the next forward waits for; ``ring.py``'s halves are synchronous loops over
isend/irecv. A ``RingQueue`` runs them on one thread, first in, first out, and hands back a ``RingWork`` with what a
``dist.Work`` offers a waiter (``wait``, ``is_completed``, ``get_future``). The one idea: the ring's messages travel
on a process group made for them (``dist.new_group`` over the same ranks, once, when the queue is built), so they
never interleave with the collectives the caller issues on its own group meanwhile, and the thread's order is the
launch order, the same on every rank. A failure fails its work and every later one (the ranks' sequences no longer
match) with a RuntimeError naming the op and its label; a peer that dies or stops answering fails the op within the
group's timeout, which the ring group takes from the caller's. The thread costs the GIL for its Python between
messages (a few calls a segment; the adds and the waits release it).
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.collectives.peers import Peers
from lockstep.collectives.ring import DEFAULT_SEGMENT_NBYTES, ring_all_gather, ring_reduce_scatter
from lockstep.process_group import on_shutdown

_STOP = object()  # the sentinel that ends a lane's thread, queued behind the ops in flight


class RingWork:
    """One queued ring op: complete once the thread has finished it or failed it; ``wait`` re-raises a failure."""

    __slots__ = ("_cause", "_done", "_future", "_message", "dtype", "label", "numel", "op")

    def __init__(self, op: str, flat: torch.Tensor, label: str):
        # for ``describe``, put into words only for an error; not the tensor: a work outlives its buffer's storage
        self.op, self.label, self.numel, self.dtype = op, label, flat.numel(), flat.dtype
        self._done = threading.Event()
        self._message: str | None = None
        self._cause: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()  # for a tracer's done-callback (get_future)

    @property
    def describe(self) -> str:
        """What the op carries: "ring reduce-scatter of bucket 3 (1,200 x torch.float32)"."""
        of = f" of {self.label}" if self.label else ""
        return f"{self.op}{of} ({self.numel:,} x {self.dtype})"

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the op is done; a RuntimeError if it failed (or did not end within ``timeout``)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if not self._done.wait(seconds):
            raise RuntimeError(f"lockstep {self.describe}: not finished within {seconds} s")
        if self._message is not None:
            raise RuntimeError(self._message) from self._cause
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _finish(self, message: str | None = None, cause: BaseException | None = None) -> None:
        self._message, self._cause = message, cause
        if message is None:  # the future first: a waiter woken by the event finds it done too
            self._future.set_result(None)
        else:
            self._future.set_exception(RuntimeError(message))
        self._done.set()


class _Lane:
    """The thread, its queue and the ring group's peers; owned by one ``RingQueue``, held by the thread (not the
    other way round, so a dropped queue closes it: ``weakref.finalize``)."""

    def __init__(self, peers: Peers, segment_nbytes: int):
        self.peers, self.segment_nbytes = peers, segment_nbytes
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.error: str | None = None  # the first failure: every later op fails with it, issuing nothing
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.closed = False

    def submit(self, work: RingWork, run: Callable[[], None]) -> RingWork:
        with self.lock:
            if self.closed:  # no thread would ever take it: a hang at the waiter
                raise RuntimeError(f"lockstep {work.describe}: the ring queue is closed (lockstep.shutdown())")
            if self.thread is None:
                self.thread = threading.Thread(target=_run, args=(self,), name="lockstep-ring", daemon=True)
                self.thread.start()
            self.inbox.put((work, run))
        return work

    def close(self, timeout_s: float = 1.0) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.thread is not None:
                self.inbox.put(_STOP)  # behind the ops in flight: they finish first
        if self.thread is not None:
            self.thread.join(timeout_s)  # one stuck on a dead peer stays behind (a daemon: exit does not wait)


def _run(lane: _Lane) -> None:
    """The lane's thread: ops in submission order; a failure ends every later op at once."""
    torch.set_grad_enabled(False)  # per thread: in-place adds into buffers that views of parameters share
    while True:
        item = lane.inbox.get()
        if item is _STOP:
            return
        work, run = item
        if lane.error is not None:
            work._finish(f"lockstep {work.describe}: not run, an earlier ring op failed: {lane.error}")
            continue
        try:
            run()
        except BaseException as e:  # everything reaches the waiter: a bare thread would only print it
            rank = lane.peers.global_ranks[lane.peers.rank]
            lane.error = (f"lockstep {work.describe} failed on global rank {rank} (group rank {lane.peers.rank} of "
                          f"{lane.peers.world_size}); a peer probably died or stopped taking part: {e}")
            work._finish(lane.error, e)
            continue
        work._finish()


_LIVE: weakref.WeakSet[RingQueue] = weakref.WeakSet()


def _close_all() -> None:
    for ring in list(_LIVE):
        ring.close()


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group`` was made with (None where the backend does not say: torch's default applies)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout  # gloo's; a private attribute
    except (AttributeError, RuntimeError):
        return None


class RingQueue:
    """Ring reduce-scatters and all-gathers over the ranks of ``group``, run one at a time on a thread in launch
    order (module docstring). Construction makes the ring's group: every rank of ``group`` must construct it at the
    same point, in the same order with any other group it makes. Every rank must submit the same ops in the same
    order, as with any collective."""

    def __init__(self, group: dist.ProcessGroup, segment_nbytes: int = DEFAULT_SEGMENT_NBYTES):
        ranks = dist.get_process_group_ranks(group)
        # Only the members call new_group where ``group`` is not the world (local synchronisation); a new gloo
        # group is a rendezvous through the store, a connection to each peer and 3 gloo threads, once (1.5 ms at 2
        # ranks on loopback), kept for the life of the process (torch frees a group only with them all). A group of
        # one sends nothing: no group made.
        ring_group = group if len(ranks) == 1 else dist.new_group(
            ranks, timeout=group_timeout(group), backend=dist.get_backend(group),
            use_local_synchronization=len(ranks) != dist.get_world_size())
        assert ring_group is not None  # this rank is in ``ranks``
        self._lane = _Lane(Peers.of(ring_group), segment_nbytes)
        weakref.finalize(self, self._lane.close)
        if not _LIVE:
            on_shutdown(_close_all)  # lockstep.shutdown(): the thread stops before the groups go
        _LIVE.add(self)

    @property
    def sent_nbytes(self) -> int:
        """Bytes this rank has sent on the ring so far (the ops finished and the one running)."""
        return self._lane.peers.sent_nbytes

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor | None = None, label: str = "") -> RingWork:
        """Start ``ring_reduce_scatter(flat, out=out)``: this rank's chunk summed into ``out`` (else in place);
        ``flat`` and ``out`` are the thread's until the work completes."""
        work = RingWork("ring reduce-scatter", flat, label)
        lane = self._lane
        return lane.submit(work, lambda: ring_reduce_scatter(flat, lane.peers, out, lane.segment_nbytes))

    def all_gather(self, flat: torch.Tensor, label: str = "") -> RingWork:
        """Start ``ring_all_gather(flat)``: every rank's chunk into ``flat``, this rank's own read from it."""
        work = RingWork("ring all-gather", flat, label)
        lane = self._lane
        return lane.submit(work, lambda: ring_all_gather(flat, lane.peers, lane.segment_nbytes))

    def close(self) -> None:
        """Stop the thread once the ops submitted so far are done (or after a second)."""
        self._lane.close()

