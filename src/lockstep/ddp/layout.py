"""The reducer's bucket layout: buckets built from an order, and the order agreed for the one rebuild.

Pure helpers that take what they need, never the reducer: ``build_layout`` runs at construction, at the rebuild
from the order gradients really came in (``agree_on_order``: rank 0's, broadcast, so every rank builds the same
buckets) and when the auto-tuner tries other caps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.ddp.buckets import assign_buckets
from lockstep.ddp.reducer_state import Bucket
from lockstep.ddp.step import COPY, VIEW


@dataclass(frozen=True)
class BucketLayout:
    """Buckets and where each parameter sits in them."""

    order: list[int]
    """The parameter order the buckets were filled in (reverse registration order, then the observed one)."""
    buckets: list[Bucket]
    """In launch order; each owns its flat buffer."""
    location: list[tuple[int, int]]
    """Per parameter index, its (bucket index, slot)."""
    sizes: list[int]
    """Per bucket, how many parameters it holds (a backward's countdown starts there)."""


def build_layout(
    params: Sequence[torch.nn.Parameter],
    order: list[int],
    cap_bytes: int,
    first_bytes: int,
    caps_bytes: Sequence[int] | None,
    direct_min_bytes: int | None,
    mode: str,
    sparse: Sequence[bool],
    shards: int = 0,
) -> BucketLayout:
    """Fresh buckets for ``params`` filled in ``order`` (``buckets.assign_buckets`` has the caps' rules): direct
    buckets only where gradients are copied in (COPY); with bucket views (VIEW) the gradients move into them.
    ``shards`` (ZeRO-2: the world size): no direct buckets, each buffer padded to a multiple of it."""
    direct = direct_min_bytes if mode == COPY and not shards else None
    plans = assign_buckets(params, order, cap_bytes, first_bytes, caps_bytes, direct, sparse if any(sparse) else None)
    for plan in plans if shards else ():
        plan.padded_numel = -(-plan.numel // shards) * shards
    buckets = [Bucket(b, plan, params) for b, plan in enumerate(plans)]
    if mode == VIEW:
        move_grads_into(buckets)
    location = [(0, 0)] * len(params)
    for bucket in buckets:
        for slot, i in enumerate(bucket.plan.param_indices):
            location[i] = (bucket.index, slot)
    return BucketLayout(order, buckets, location, [len(b.params) for b in buckets])


def move_grads_into(buckets: Sequence[Bucket]) -> None:
    """Bucket views (VIEW mode): existing gradients move into the new buffers, so no accumulated value is lost."""
    for bucket in buckets:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = view


def agree_on_order(observed: list[int], num_params: int, first_bytes: int, group: dist.ProcessGroup,
                   buffer_device: torch.device) -> tuple[list[int], int]:
    """Rank 0's observed ready order and first-bucket cap, on every rank (sent from ``buffer_device`` under NCCL).

    Parameters never ready go last, in reverse registration order. Costs one broadcast of ``num_params + 1``
    integers, once per run; rank 0's first-bucket cap rides with them (ranks may judge their machines
    differently; the layouts must agree).
    """
    seen = set(observed)
    order = observed + [i for i in reversed(range(num_params)) if i not in seen]
    device = buffer_device if dist.get_backend(group) == "nccl" else "cpu"
    order_t = torch.tensor([*order, first_bytes], dtype=torch.int64, device=device)
    dist.broadcast(order_t, src=dist.get_global_rank(group, 0), group=group)
    *agreed, first = order_t.tolist()
    return agreed, first
