"""Ring all-reduce over point-to-point messages: reduce-scatter, then all-gather.

The buffer is cut into N chunks. In the reduce-scatter each rank sends one chunk
to its right neighbour and adds the chunk arriving from its left, N-1 times, after
which rank r owns the full sum of chunk (r+1) mod N; the all-gather then passes
the finished chunks round the ring N-1 more times. Every rank sends
2(N-1)/N of the buffer in 2(N-1) steps, which is why the ring is bandwidth-optimal
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", 2009; the same schedule as Baidu's ring all-reduce and NCCL's).

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


def ring_all_reduce(
    flat: torch.Tensor, peers: Peers, segment_nbytes: int = DEFAULT_SEGMENT_NBYTES
) -> None:
    """Sum ``flat`` (1-D, contiguous) in place across the ranks of ``peers``."""
    n, r = peers.world_size, peers.rank
    if n == 1 or flat.numel() == 0:
        return
    right, left = (r + 1) % n, (r - 1) % n
    bounds = chunk_bounds(flat.numel(), n)
    segment_numel = pick_segment_numel(bounds[0][1] - bounds[0][0], segment_nbytes, flat.element_size())
    chunk_segments = [segments(lo, hi, segment_numel) for lo, hi in bounds]
    # Tags are step * stride + segment: sender and receiver derive the same number.
    stride = max(len(s) for s in chunk_segments)
    max_chunk = bounds[0][1] - bounds[0][0]

    # --- reduce-scatter: step s sends chunk (r-s) and adds chunk (r-s-1) ---
    # Receives land in a small pool of segment buffers rather than a chunk-sized
    # one: memory stays at RECV_DEPTH segments whatever the tensor size, and the
    # pool is reused across calls (receive_scratch), so the buffers stay
    # cache-hot and no fresh allocation page-faults on every call.
    # Segment i is received into pool[i % depth]; its buffer is re-posted for
    # segment i + depth as soon as segment i has been added.
    items = [
        (step, k, a, b)
        for step in range(n - 1)
        for k, (a, b) in enumerate(chunk_segments[(r - step - 1) % n])
    ]
    sends_by_step: list[list] = [[] for _ in range(2 * n - 2)]
    first_sends = chunk_segments[r]
    depth = min(RECV_DEPTH, len(items))

    def send_first(k: int) -> None:
        a, b = first_sends[k]
        sends_by_step[0].append(peers.isend(flat[a:b], right, k))

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
    pool_numel = min(segment_numel, max_chunk)
    pool = receive_scratch(flat, depth * pool_numel).split(pool_numel)
    posted: deque[dist.Work] = deque()

    def post(i: int) -> None:
        step, k, a, b = items[i]
        posted.append(peers.irecv(pool[i % depth][: b - a], left, step * stride + k))

    for i in range(depth):
        post(i)

    # The all-gather's receives, straight into `flat`, are posted now too. Posted
    # after the reduce-scatter instead, the two directions of the last exchange
    # serialised: a neighbour that was ahead wrote its whole message from inside
    # isend (see above) before it posted its own receive, and only then could this
    # rank's data start (4 MiB on 2 ranks, one side-by-side run: 0.79x native
    # against 0.90x posted early). Nothing can land early: a chunk's finished
    # value includes what this rank sent from that range, so it arrives only after
    # the right neighbour has read all of those sends, i.e. after they have left
    # the buffer.
    ag_recvs = []
    for s in range(n - 1):
        step = n - 1 + s
        ag_recvs.append(
            [
                (peers.irecv(flat[a:b], left, step * stride + k), flat[a:b])
                for k, (a, b) in enumerate(chunk_segments[(r - s) % n])
            ]
        )
    if whole_chunks:
        for k in range(min(depth, len(first_sends))):
            send_first(k)
    for i, (step, k, a, b) in enumerate(items):
        posted.popleft().wait()
        flat[a:b].add_(pool[i % depth][: b - a])
        if i + depth < len(items):
            post(i + depth)
        if i + depth < len(first_sends):
            send_first(i + depth)
        # The segment just reduced is sent on the next step; after the last
        # reduce-scatter step it is this rank's finished chunk, which the
        # all-gather's first step sends. Either way it can go now.
        sends_by_step[step + 1].append(peers.isend(flat[a:b], right, (step + 1) * stride + k))

    for k in range(len(items) + depth, len(first_sends)):  # a longer first chunk than received ones
        send_first(k)

    # --- all-gather: step s receives chunk (r-s) straight into `flat` ---
    # (receives posted before the reduce-scatter) and forwards it on the next step.
    for s in range(n - 1):
        for k, (work, dst) in enumerate(ag_recvs[s]):
            work.wait()
            if s + 1 < n - 1:  # forward it on the next step
                sends_by_step[n + s].append(peers.isend(dst, right, (n + s) * stride + k))
    for step_sends in sends_by_step:
        wait_all(step_sends)
