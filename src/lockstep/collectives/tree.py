"""Tree all-reduce by recursive doubling: latency-optimal for small buffers.

In round k every rank swaps its whole partial sum with the rank whose index
differs in bit k and adds it, so after log2(N) rounds every rank holds the total:
a butterfly, which is a binomial-tree reduce and a binomial-tree broadcast fused
into one pass (Thakur, Rabenseifner & Gropp, "Optimization of collective
communication operations in MPICH", 2005). It pays log2(N) latencies where the ring
pays 2(N-1), but moves the whole buffer every round, so the ring wins once the
buffer is large (see ``lockstep plan`` and ``lockstep bench allreduce``).

A world size that is not a power of two is folded first: with p the largest power
of two <= N, rank p+i hands its buffer to rank i, the first p ranks run the
butterfly, and rank i hands the result back (two extra rounds). Floating-point
addition is commutative, so both partners of a swap compute bit-identical sums and
every rank ends with exactly the same bits, which DDP's replicas rely on.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from lockstep.collectives.peers import Peers, segments, wait_all
from lockstep.collectives.ring import RECV_DEPTH

# Larger segments than the ring's 1 MiB: every tree segment is a two-way exchange
# whose send must complete before the segment is overwritten, so the per-segment
# round trip costs more; measured on loopback, 4 MiB segments took a 16 MiB
# buffer from 29 ms to 17 ms (the ring's time). Memory: RECV_DEPTH segments.
TREE_SEGMENT_NBYTES = 4 << 20


def tree_all_reduce(
    flat: torch.Tensor, peers: Peers, segment_nbytes: int = TREE_SEGMENT_NBYTES
) -> None:
    """Sum ``flat`` (1-D, contiguous) in place across the ranks of ``peers``."""
    n, r = peers.world_size, peers.rank
    if n == 1 or flat.numel() == 0:
        return
    segment_numel = max(1, segment_nbytes // flat.element_size())
    pieces = segments(0, flat.numel(), segment_numel)
    stride = len(pieces)
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p
    depth = min(RECV_DEPTH, len(pieces))
    # A few segment-sized receive buffers, reused round after round (see ring.py).
    pool = [flat.new_empty(min(segment_numel, flat.numel())) for _ in range(depth)]
    fold_in_tag, fold_out_tag = 0, 1  # the butterfly rounds use tags from 2 * stride on

    if r >= p:  # folded rank: contribute, then wait for the answer
        partner = r - p
        wait_all([peers.isend(flat[a:b], partner, fold_in_tag * stride + k) for k, (a, b) in enumerate(pieces)])
        wait_all([peers.irecv(flat[a:b], partner, fold_out_tag * stride + k) for k, (a, b) in enumerate(pieces)])
        return
    if r < extra:
        _exchange_add(flat, pool, pieces, peers, r + p, fold_in_tag * stride, send=False)

    mask, round_index = 1, 2
    while mask < p:
        _exchange_add(flat, pool, pieces, peers, r ^ mask, round_index * stride, send=True)
        mask <<= 1
        round_index += 1

    if r < extra:
        wait_all([peers.isend(flat[a:b], r + p, fold_out_tag * stride + k) for k, (a, b) in enumerate(pieces)])


def _exchange_add(
    flat: torch.Tensor, pool: list[torch.Tensor], pieces: list[tuple[int, int]], peers: Peers, partner: int,
    tag0: int, send: bool,
) -> None:
    """Add the partner's buffer into ``flat`` (sending ours to it at the same time if ``send``).

    Segment k is added as soon as it lands, overlapping the transfer of k+1; a
    segment of ``flat`` is only overwritten after our own send of it completed.
    """
    depth = len(pool)
    sends: list[dist.Work] = []

    def post_send(k: int) -> None:
        # Paced `depth` ahead of the receives, as in ring.py: a deep queue of
        # outgoing data holds up the control messages of the opposite direction.
        if send and k < len(pieces):
            a, b = pieces[k]
            sends.append(peers.isend(flat[a:b], partner, tag0 + k))

    def post_recv(k: int) -> dist.Work:
        a, b = pieces[k]
        return peers.irecv(pool[k % depth][: b - a], partner, tag0 + k)

    for k in range(depth):
        post_send(k)
    recvs = deque(post_recv(k) for k in range(depth))
    for k, (a, b) in enumerate(pieces):
        recvs.popleft().wait()
        if send:
            sends[k].wait()  # segment k of `flat` is about to change: our copy must have left
        flat[a:b].add_(pool[k % depth][: b - a])
        if k + depth < len(pieces):
            recvs.append(post_recv(k + depth))
            post_send(k + depth)
