"""Ring all-reduce over point-to-point messages: reduce-scatter, then all-gather.

The buffer is cut into N chunks (``chunk_bounds``). In the reduce-scatter each rank
sends one chunk to its right neighbour and adds the chunk arriving from its left,
N-1 times, after which rank r owns the full sum of chunk r (its first send is chunk
r-1, so the last add lands on its own: a padded buffer's slice r, a ZeRO shard, with
no copy); the all-gather then passes the finished chunks round the ring N-1 more
times. Every rank sends (N-1)/N of the buffer in each half, 2(N-1)/N in 2(N-1)
steps, which is why the ring is bandwidth-optimal (Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", 2009; the same
schedule as Baidu's ring all-reduce and NCCL's). The halves are callable alone
(``ring_reduce_scatter``, ``ring_all_gather``: ZeRO-2's pair, ``ring_queue``);
``ring_all_reduce`` is the two run as one schedule.

Each chunk travels in segments, and a segment is forwarded as soon as it is added
rather than when the whole chunk is: the add of segment k overlaps the transfer of
segment k+1, and the next step's send starts before this step's receive ends
(pipelining, as NCCL does). The all-gather receives straight into the caller's
tensor, so the only copy is through the few segment-sized receive buffers of the
reduce-scatter.
"""

from __future__ import annotations

import threading
from collections import deque

import torch
import torch.distributed as dist

from lockstep.collectives.peers import Peers, chunk_bounds, segments, wait_all

# 1 MiB segments: big enough that per-message overhead (a Python call and a gloo
# round of bookkeeping, tens of microseconds) stays below ~5% at loopback speeds,
# small enough that a 4 MiB chunk is still cut into a pipeline of four.
DEFAULT_SEGMENT_NBYTES = 1 << 20
# Receive buffers in flight per rank: enough to keep the link busy while one is added.
RECV_DEPTH = 4
# Largest receive pool kept between calls (per thread, dtype and device); a
# bigger one (a caller's huge segment_nbytes) is allocated per call and freed.
SCRATCH_KEEP_MAX_NBYTES = 64 << 20

_scratch = threading.local()


def receive_scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D buffer of ``numel`` elements of ``like``'s dtype and device, reused across calls.

    A fresh multi-MiB tensor per call made the 4 MiB all-reduce on 2 ranks about
    0.5 ms (15-25%) slower: the kernel zero-fills and maps every page on first
    touch. Keeping the pool costs RECV_DEPTH segments (at most 8 MiB at the
    default segment size) per thread, dtype and device for the life of the
    process. Per thread, so two threads reducing at once never share a buffer;
    the ring waits for all its receives before returning, so no call outlives its
    use of the buffer.
    """
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    key = (like.device, like.dtype)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = like.new_empty(numel)
        if buf.numel() * buf.element_size() <= SCRATCH_KEEP_MAX_NBYTES:
            buffers[key] = buf
    return buf[:numel]


def pick_segment_numel(chunk_numel: int, segment_nbytes: int, element_size: int) -> int:
    """Elements per message for chunks of ``chunk_numel``: ``segment_nbytes`` worth, or the whole chunk.

    A chunk of at most two segments goes as one message. Pipelining two segments
    hides at most one segment's add (~0.1 ms per MiB here), while each extra
    message costs a send/receive handshake and a Python round of
    isend/irecv/wait; at 2 ranks and 4 MiB (2 MiB chunks) whole chunks measured
    faster than 1 MiB segments. Longer chunks keep the pipeline.
    """
    if segment_nbytes < 1:
        raise ValueError(f"segment_nbytes must be >= 1, got {segment_nbytes}")
    segment_numel = max(1, segment_nbytes // element_size)
    return max(1, chunk_numel) if chunk_numel <= 2 * segment_numel else segment_numel


class _Ring:
    """One call's schedule over ``flat`` and the sends it has in flight.

    Rank r's reduce-scatter step s sends chunk r-s-1 and adds chunk r-s-2 (mod N); its all-gather step s sends the
    chunk it finished or received last and receives chunk r-s-1 straight into ``flat``. Tags are step * stride +
    segment, steps 0..N-2 the reduce-scatter's and N-1..2N-3 the all-gather's: sender and receiver derive the same
    number, and the halves run alone never share a tag with each other.
    """

    def __init__(self, flat: torch.Tensor, peers: Peers, segment_nbytes: int):
        self.flat, self.peers = flat, peers
        self.n, self.r = peers.world_size, peers.rank
        self.right, self.left = (self.r + 1) % self.n, (self.r - 1) % self.n
        self.bounds = chunk_bounds(flat.numel(), self.n)
        self.max_chunk = self.bounds[0][1] - self.bounds[0][0]
        self.segment_numel = pick_segment_numel(self.max_chunk, segment_nbytes, flat.element_size())
        self.chunks = [segments(lo, hi, self.segment_numel) for lo, hi in self.bounds]
        self.stride = max(len(s) for s in self.chunks)
        self.sends: list[dist.Work] = []
        self.gather_recvs: list[list[tuple[dist.Work, torch.Tensor]]] = []

    def send(self, a: int, b: int, step: int, k: int) -> None:
        self.sends.append(self.peers.isend(self.flat[a:b], self.right, step * self.stride + k))

    def post_gather_receives(self) -> None:
        """The all-gather's receives, every step's, straight into ``flat``."""
        n, r, flat = self.n, self.r, self.flat
        for s in range(n - 1):
            tag = (n - 1 + s) * self.stride
            self.gather_recvs.append([(self.peers.irecv(flat[a:b], self.left, tag + k), flat[a:b])
                                      for k, (a, b) in enumerate(self.chunks[(r - s - 1) % n])])

    def reduce_scatter(self, out: torch.Tensor | None, then_gather: bool) -> None:
        """Chunk r summed over the ranks, into ``out`` where given (the last add writes there: no copy) else in
        place; the other chunks are left holding partial sums. ``then_gather``: post the all-gather's receives too,
        and send each finished segment on at once as the all-gather's first step."""
        n, r, flat, stride = self.n, self.r, self.flat, self.stride
        items = [(step, k, a, b) for step in range(n - 1) for k, (a, b) in enumerate(self.chunks[(r - step - 2) % n])]
        first_sends = self.chunks[(r - 1) % n]
        depth = min(RECV_DEPTH, len(items))

        def send_first(k: int) -> None:
            self.send(*first_sends[k], 0, k)

        # The first step's sends are paced, `depth` ahead of the receives, rather than
        # all posted at once: a deep queue of outgoing data on the socket delays the
        # small control messages gloo needs to start the transfers coming the other
        # way, which serialised the two directions (ring at 0.35x native at 256 MiB).
        # No deadlock: send k+depth waits only for receive k, which needs the left
        # neighbour's send k, which waits only for its receive k-depth, and so on down.
        #
        # When they go is a trade-off measured on 2 ranks. When the receiver is
        # already waiting, gloo writes the whole message from inside isend (about
        # 1 ms for 2 MiB here), blocking this thread. With pipelined segments, sends
        # go before this rank posts its receives: they are usually only announced,
        # and written later by gloo's I/O thread while this one adds (receives first
        # cost ~5-10% at 16 MiB). With one message per chunk, receives go first: sent
        # first, a rank that left the starting line later wrote its whole chunk from
        # isend before posting its receive, so the other direction waited for it
        # (4 MiB: 0.71-1.01x native over six runs, 0.81-1.07x with receives first).
        whole_chunks = stride == 1
        if not whole_chunks:
            for k in range(min(depth, len(first_sends))):
                send_first(k)
        # Receives land in a small pool of segment buffers rather than a chunk-sized
        # one: memory stays at RECV_DEPTH segments whatever the tensor size, and the
        # pool is reused across calls (receive_scratch), so the buffers stay
        # cache-hot and no fresh allocation page-faults on every call. Segment i is
        # received into pool[i % depth]; its buffer is re-posted for segment i + depth
        # as soon as segment i has been added.
        pool_numel = min(self.segment_numel, self.max_chunk)
        pool = receive_scratch(flat, depth * pool_numel).split(pool_numel)
        posted: deque[dist.Work] = deque()

        def post(i: int) -> None:
            step, k, a, b = items[i]
            posted.append(self.peers.irecv(pool[i % depth][: b - a], self.left, step * stride + k))

        for i in range(depth):
            post(i)
        if then_gather:
            # Posted now, not after the reduce-scatter: posted later, the two directions
            # of the last exchange serialised (a neighbour that was ahead wrote its whole
            # message from inside isend before it posted its own receive; 4 MiB on 2
            # ranks: 0.79x native against 0.90x posted early). Nothing can land early: a
            # chunk's finished value includes what this rank sent from that range, so it
            # arrives only after the right neighbour has read all of those sends.
            self.post_gather_receives()
        if whole_chunks:
            for k in range(min(depth, len(first_sends))):
                send_first(k)
        own_start = self.bounds[r][0]
        for i, (step, k, a, b) in enumerate(items):
            posted.popleft().wait()
            received = pool[i % depth][: b - a]
            if out is not None and step == n - 2:  # chunk r's last add: straight into the caller's output
                torch.add(flat[a:b], received, out=out[a - own_start: b - own_start])
            else:
                flat[a:b].add_(received)
            if i + depth < len(items):
                post(i + depth)
            if i + depth < len(first_sends):
                send_first(i + depth)
            # The segment just reduced is sent on the next step; after the last step it
            # is this rank's finished chunk, which the all-gather's first step sends.
            if step < n - 2 or then_gather:
                self.send(a, b, step + 1, k)
        for k in range(len(items) + depth, len(first_sends)):  # a longer first chunk than received ones
            send_first(k)

    def all_gather(self, send_own: bool) -> None:
        """Every chunk from its owner into ``flat`` (receives posted already); ``send_own``: this rank's chunk r
        goes first (else the reduce-scatter sent it as it finished)."""
        n = self.n
        if send_own:
            for k, (a, b) in enumerate(self.chunks[self.r]):
                self.send(a, b, n - 1, k)
        for s, recvs in enumerate(self.gather_recvs):
            for k, (work, dst) in enumerate(recvs):
                work.wait()
                if s + 1 < n - 1:  # forward it on the next step
                    self.sends.append(self.peers.isend(dst, self.right, (n + s) * self.stride + k))

    def finish(self) -> None:
        wait_all(self.sends)


def ring_all_reduce(
    flat: torch.Tensor, peers: Peers, segment_nbytes: int = DEFAULT_SEGMENT_NBYTES
) -> None:
    """Sum ``flat`` (1-D, contiguous) in place across the ranks of ``peers``."""
    if peers.world_size == 1 or flat.numel() == 0:
        return
    ring = _Ring(flat, peers, segment_nbytes)
    ring.reduce_scatter(None, then_gather=True)
    ring.all_gather(send_own=False)
    ring.finish()


def ring_reduce_scatter(
    flat: torch.Tensor, peers: Peers, out: torch.Tensor | None = None, segment_nbytes: int = DEFAULT_SEGMENT_NBYTES
) -> None:
    """Rank r's chunk of ``flat`` (``chunk_bounds(flat.numel(), N)[r]``: slice r of a buffer padded to a multiple
    of N) summed across the ranks of ``peers``: into ``out`` (that chunk's length) where given, else in place. The
    rest of ``flat`` is left holding partial sums. Each rank sends (N-1)/N of the buffer."""
    lo, hi = chunk_bounds(flat.numel(), peers.world_size)[peers.rank]
    if out is not None and out.numel() != hi - lo:
        raise ValueError(f"ring_reduce_scatter: out has {out.numel()} elements, rank {peers.rank}'s chunk {hi - lo}")
    if peers.world_size == 1 or flat.numel() == 0:
        if out is not None:
            out.copy_(flat)
        return
    ring = _Ring(flat, peers, segment_nbytes)
    ring.reduce_scatter(out, then_gather=False)
    ring.finish()


def ring_all_gather(flat: torch.Tensor, peers: Peers, segment_nbytes: int = DEFAULT_SEGMENT_NBYTES) -> None:
    """Every rank's chunk of ``flat`` (rank r holds ``chunk_bounds(flat.numel(), N)[r]``) into every rank's
    ``flat``, in place. Each rank sends (N-1)/N of the buffer."""
    if peers.world_size == 1 or flat.numel() == 0:
        return
    ring = _Ring(flat, peers, segment_nbytes)
    ring.post_gather_receives()
    ring.all_gather(send_own=True)
    ring.finish()
