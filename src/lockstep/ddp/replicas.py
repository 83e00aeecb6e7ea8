"""Making replicas start identical: check every rank built the same model, then copy rank 0's state.

The check gathers each rank's (name, shape, dtype) list to every rank, so each rank
finds the same first difference and raises the same error: no rank is left waiting
in a collective the others skipped. The copy broadcasts flat per-dtype chunks, so a
model with hundreds of tensors costs a few collectives, not hundreds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # bounds the extra memory of the flat copy


def _describe(shape: tuple, dtype: str) -> str:
    return f"shape {tuple(shape)} dtype {dtype}"


def verify_params_across_ranks(named_params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """Raise the same RuntimeError on every rank if the ranks' parameters differ in count, name, shape or dtype.

    The text names the parameter and both ranks, and carries torch's own phrases ("DDP expects same model
    across all ranks" for a count, "appears not to match sizes of the same param in process 0" for a shape),
    which torch 2.4's DDP tests and scripts written against its error match. Unlike torch's check, every
    rank raises the same error (torch raises on the mismatching ranks). Costs one all_gather_object (a
    pickle per rank) at construction only.
    """
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named_params]
    world_size = dist.get_world_size(group)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    reference = gathered[0]
    for rank in range(1, world_size):
        theirs = gathered[rank]
        for i in range(max(len(reference), len(theirs))):
            if i >= len(reference) or i >= len(theirs):
                extra_rank, extra = (rank, theirs) if i >= len(reference) else (0, reference)
                name = extra[i][0]
                raise RuntimeError(
                    "DistributedDataParallel: the model differs across ranks (DDP expects same model across all "
                    "ranks): rank 0 has "
                    f"{len(reference)} parameters and rank {rank} has {len(theirs)}; the first unmatched one is "
                    f"{name!r} on rank {extra_rank}. Every rank must construct the same model."
                )
            (name0, shape0, dtype0), (name_r, shape_r, dtype_r) = reference[i], theirs[i]
            if (name0, shape0, dtype0) != (name_r, shape_r, dtype_r):
                where = (
                    f"parameter {name0!r}"
                    if name0 == name_r
                    else f"parameter #{i} ({name0!r} on rank 0, {name_r!r} on rank {rank})"
                )
                what = "sizes" if shape0 != shape_r else "dtype" if dtype0 != dtype_r else "name"
                raise RuntimeError(
                    f"DistributedDataParallel: the model differs across ranks: {where} has "
                    f"{_describe(shape0, dtype0)} on rank 0 but {_describe(shape_r, dtype_r)} on rank {rank} "
                    f"(rank {rank}'s params[{i}] appears not to match {what} of the same param in process 0). "
                    "Every rank must construct the same model."
                )


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, src_group_rank: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with the source rank's values, a few flat collectives at a time.

    The tensors of one device travel together as raw bytes, whatever their dtypes (a broadcast copies, it
    does not add, so the bits arrive as they left): a BatchNorm model's float statistics and int64 step
    counters take one collective per forward, not one per dtype. Costs one flat copy per chunk of up
    to ``BROADCAST_CHUNK_BYTES`` (cat, broadcast, copy back).
    """
    src = dist.get_global_rank(group, src_group_rank)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for same_device in by_device.values():
        # Widest elements first, so every tensor starts at a byte offset its element size divides.
        same_device.sort(key=lambda t: -t.element_size())
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for t in same_device:
            chunk.append(t)
            nbytes += t.numel() * t.element_size()
            if nbytes >= BROADCAST_CHUNK_BYTES:
                _broadcast_flat(chunk, group, src)
                chunk, nbytes = [], 0
        if chunk:
            _broadcast_flat(chunk, group, src)


def _broadcast_flat(chunk: list[torch.Tensor], group: dist.ProcessGroup, src: int) -> None:
    flat = pack_bytes(chunk)
    dist.broadcast(flat, src=src, group=group)
    unpack_bytes(flat, chunk)


def pack_bytes(chunk: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, as they are, in one uint8 tensor (one copy); widest dtypes first keeps offsets aligned."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in chunk])


def unpack_bytes(flat: torch.Tensor, chunk: list[torch.Tensor]) -> None:
    """``pack_bytes`` undone: each tensor gets its bytes back from ``flat`` (one copy)."""
    with torch.no_grad():
        offset = 0
        for t in chunk:
            size = t.numel() * t.element_size()
            t.copy_(flat[offset : offset + size].view(t.dtype).view_as(t))
            offset += size


def syncable_buffers(module: torch.nn.Module, ignore: frozenset[str] | set[str] = frozenset()) -> list[torch.Tensor]:
    """Buffers of floating or integer dtype (BatchNorm statistics, step counters); bool and complex stay local.

    Read afresh from the module each time (a module walk, tens of microseconds): a buffer may be
    reassigned, not only changed in place, and the new tensor is the one to broadcast.
    """
    return list(named_syncable_buffers(module, ignore).values())


def named_syncable_buffers(
    module: torch.nn.Module, ignore: frozenset[str] | set[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """``syncable_buffers`` by qualified name (what a buffer comm hook receives)."""
    return {
        name: b
        for name, b in module.named_buffers()
        if name not in ignore and is_syncable(b)
    }


def is_syncable(buffer: torch.Tensor) -> bool:
    """Whether DDP broadcasts this buffer: floating or integer dtypes (statistics, counters); bool and complex stay
    local."""
    return buffer.dtype.is_floating_point or (not buffer.dtype.is_complex and buffer.dtype != torch.bool)
