"""The reducer's bucket layout: built from an order, rebuilt once from the order gradients really came in,
re-laid with other caps by the auto-tuner. A mixin of ``Reducer`` (its state is the reducer's)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lockstep.ddp.buckets import assign_buckets
from lockstep.ddp.copy_in import COPY
from lockstep.ddp.launch_order import LaunchOrder
from lockstep.ddp.reducer_state import Bucket


class Layout:
    """``_build``, ``bucket_layout``, ``rebuild_buckets`` and ``relayout`` of ``Reducer``."""

    params: list
    buckets: list
    process_group: Any
    bucket_cap_bytes: int
    first_bucket_bytes: int
    rebuilt_first_bucket_bytes: int
    bucket_caps_bytes: Any
    direct_min_bytes: Any
    grad_mode: str
    gradient_as_bucket_view: bool
    sparse: list
    has_sparse: bool
    layout_version: int
    buckets_rebuilt: bool
    rebuild_pending: bool
    _observed_order: Any

    def _build(self, order: list[int]) -> None:
        if self.buckets:
            self.release_works(keep=False)  # before the old buckets go
        self._param_order = order
        direct = self.direct_min_bytes if self.grad_mode == COPY else None
        plans = assign_buckets(self.params, order, self.bucket_cap_bytes, self.first_bucket_bytes, self.bucket_caps_bytes, direct,
                               self.sparse if self.has_sparse else None)
        self.buckets = [Bucket(b, plan, self.params) for b, plan in enumerate(plans)]
        self._location = [(0, 0)] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.plan.param_indices):
                self._location[i] = (bucket.index, slot)
        self._sizes = [len(b.params) for b in self.buckets]
        self._order = LaunchOrder(self.buckets, self._launch, self._hook_one_in_flight)
        self.layout_version += 1  # ``grad_hook.fast_table``'s cache key
        self._reset()
        if self.gradient_as_bucket_view:
            # Existing gradients move into the new buffers so no accumulated value is lost.
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view

    def bucket_layout(self) -> list[list[int]]:
        """Parameter indices (into ``params``) of each bucket, in launch order."""
        return [list(b.plan.param_indices) for b in self.buckets]

    def rebuild_buckets(self) -> None:
        """Rebuild once from the first synced backward's ready order (rank 0's, so all ranks agree).

        Costs one broadcast of ``len(params)`` integers, once per run; rank 0's first-bucket cap rides
        with them (ranks may judge their machines differently; the layouts must agree).
        """
        self.rebuild_pending = False
        observed = self._observed_order or []
        self._observed_order = None
        seen = set(observed)  # parameters never ready go last, in reverse registration order
        order = observed + [i for i in reversed(range(len(self.params))) if i not in seen]
        device = self.buckets[0].buffer.device if dist.get_backend(self.process_group) == "nccl" else "cpu"
        order_t = torch.tensor(order + [self.rebuilt_first_bucket_bytes], dtype=torch.int64, device=device)
        dist.broadcast(order_t, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        *order, self.first_bucket_bytes = order_t.tolist()
        self._build(order)
        self.buckets_rebuilt = True

    def relayout(self, bucket_caps_bytes: list[int]) -> None:
        """New buckets with these caps, in the current order (the auto-tuner's trials; every rank at the same round)."""
        self.bucket_caps_bytes = bucket_caps_bytes
        self._build(self._param_order)
