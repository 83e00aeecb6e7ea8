"""All-reduce written over send/recv: ring, tree, and the backend's own, behind one call.

``all_reduce(tensor, algorithm=..., group=...)`` is an in-place SUM with the same
contract as ``torch.distributed.all_reduce``: every rank of ``group`` calls it, in
the same order, with a tensor of the same shape and dtype, and every rank ends with
the same bits. ``"native"`` is the backend's all_reduce (gloo's or NCCL's),
``"ring"`` the bandwidth-optimal ring (``ring.py``), ``"tree"`` the latency-optimal
recursive doubling (``tree.py``). The algorithms are here to be read, measured
(``lockstep bench allreduce``) and modelled (``lockstep plan``); for production
traffic the native one is the default everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lockstep.collectives.peers import Peers, chunk_bounds
from lockstep.collectives.ring import DEFAULT_SEGMENT_NBYTES, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from lockstep.collectives.tree import tree_all_reduce

ALGORITHMS = ("native", "ring", "tree")

__all__ = [
    "ALGORITHMS", "DEFAULT_SEGMENT_NBYTES", "Peers", "all_reduce", "chunk_bounds", "ring_all_reduce", "tree_all_reduce",
    "ring_reduce_scatter", "ring_all_gather",
]


def all_reduce(tensor: torch.Tensor, algorithm: str = "native", group=None) -> torch.Tensor:
    """Sum ``tensor`` in place over every rank of ``group`` and return it.

    Args:
        tensor: a contiguous dense tensor of a floating, complex or integer dtype,
            same shape and dtype on every rank.
        algorithm: ``"native"`` (the backend's all_reduce), ``"ring"``
            (reduce-scatter + all-gather, 2(N-1) steps of 1/N of the buffer) or
            ``"tree"`` (recursive doubling, ceil(log2 N) rounds of the whole buffer).
        group: the process group; ``None`` means the default (world) group.

    Raises ValueError for an unknown algorithm or an unsupported tensor, and
    RuntimeError when no process group is initialised. A peer that never answers
    ends in the process group's timeout error, not a hang.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {', '.join(map(repr, ALGORITHMS))}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor must be dense (strided), got layout {tensor.layout}")
    if not tensor.is_contiguous():
        # A non-contiguous tensor has no flat view to send from and receive into in
        # place; copying it silently would hide a 2x memory cost from the caller.
        raise ValueError("tensor must be contiguous for lockstep.collectives.all_reduce (call .contiguous() first)")
    if tensor.dtype == torch.bool:
        raise ValueError("tensor of dtype torch.bool has no SUM; cast it to an integer dtype")
    peers = Peers.of(group)
    if algorithm == "native":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=peers.group)
        return tensor
    flat = tensor.view(-1)
    try:
        # no_grad: the in-place adds must work on a leaf that requires grad (a
        # parameter being synchronised), as torch.distributed.all_reduce does.
        with torch.no_grad():
            if algorithm == "ring":
                ring_all_reduce(flat, peers)
            else:
                tree_all_reduce(flat, peers)
    except RuntimeError as e:  # usually gloo's bare "Timed out waiting ... for recv": say who and what
        raise RuntimeError(
            f"lockstep {algorithm} all-reduce of {tensor.numel()} x {tensor.dtype} failed on global rank "
            f"{peers.global_ranks[peers.rank]} (group rank {peers.rank} of {peers.world_size}); a peer "
            f"probably stopped calling all_reduce or died: {e}"
        ) from e
    return tensor
