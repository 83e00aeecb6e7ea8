"""Point-to-point plumbing shared by the ring and tree all-reduces.

The algorithms think in *group* ranks (0..N-1 inside the process group they were
given), but ``torch.distributed.isend``/``irecv`` address peers by *global* rank
on every torch we support. ``Peers`` does that translation once per call, checks
that the calling rank belongs to the group, and splits a flat buffer into the
chunks and segments both algorithms walk over.

Every message carries an explicit tag: the sender and the receiver compute the
same (step, segment) pair independently, so a receive can never match the wrong
message even when many are in flight between the same two ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Peers:
    """The calling rank's view of a process group for point-to-point messages."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    global_ranks: list[int]
    # Bytes this object has sent (``isend``): the wire bytes a test or a benchmark counts; one add a message.
    sent_nbytes: int = 0

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> Peers:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "lockstep.collectives needs an initialised default process group "
                "(call lockstep.init() or torch.distributed.init_process_group() first)"
            )
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"global rank {dist.get_rank()} is not a member of the process group passed as `group`"
            )
        world_size = dist.get_world_size(group)
        if group is None or group is dist.group.WORLD:  # (None only to the type checker: WORLD is set once initialised)
            global_ranks = list(range(world_size))
        else:
            global_ranks = [dist.get_global_rank(group, r) for r in range(world_size)]
        return cls(group, rank, world_size, global_ranks)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        self.sent_nbytes += tensor.numel() * tensor.element_size()
        return _posted(dist.isend(tensor, dst=self.global_ranks[peer], group=self.group, tag=tag))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return _posted(dist.irecv(tensor, src=self.global_ranks[peer], group=self.group, tag=tag))


def _posted(work: dist.Work | None) -> dist.Work:
    # torch returns None only to a rank outside the group, which Peers.of refused: never seen here.
    if work is None:
        raise RuntimeError("torch.distributed returned no work for a message (is this rank in the group?)")
    return work


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous ranges differing by at most one.

    The first ``numel % parts`` ranges get the extra element; ranges may be empty
    when ``numel < parts`` (both ends of a message skip an empty range, so no
    zero-byte message is ever sent).
    """
    base, extra = divmod(numel, parts)
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def segments(start: int, stop: int, segment_numel: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into pieces of at most ``segment_numel`` elements."""
    return [(a, min(a + segment_numel, stop)) for a in range(start, stop, segment_numel)]


def wait_all(works: Iterable[dist.Work]) -> None:
    for work in works:
        work.wait()
