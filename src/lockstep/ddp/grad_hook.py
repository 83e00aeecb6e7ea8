"""The per-parameter hook: autograd calls it once per parameter per backward, so its common path is short.

torch's DDP runs this step in C++; here it is a Python call per parameter, and on a model of many small tensors
that call is most of what lockstep spends beyond torch (the 51-tensor bench transformer: ~25 us a parameter
through ``Reducer.on_grad``, ``_mark_ready`` and ``copy_in``, each re-checking a mode that cannot change inside a
backward). So where the backward's plan has a common-path table (``step.fast_table``: copies, no usage
tracking, buckets rebuilt, no event log), the hook does only what that path needs (mark the slot, one fused
scale-and-copy, count down the bucket) with its bucket, slot, view and scale looked up in one list. Anything
off that path (no gradient, a gradient twice, one carrying a graph or sparse, a direct or sparse bucket) goes
through ``Reducer.on_grad``: the common path is a subset of its steps, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from lockstep.ddp.reducer_state import UsageTracker
from lockstep.ddp.step import Backward


class HookedReducer(Protocol):
    """What the hook reads and calls on its reducer (``Reducer``)."""

    step: Backward | None
    expect_hooks: bool
    usage: UsageTracker

    def on_grad(self, index: int, param: torch.Tensor) -> None: ...
    def bucket_full(self, step: Backward, b: int) -> None: ...


def make_hook(reducer_ref: Callable[[], HookedReducer | None], index: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``index``'s post-accumulate-grad hook; holds the reducer weakly (parameters outlive a dropped DDP)."""

    def hook(param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is None:
            return
        step = reducer.step
        if step is not None:
            fast = step.plan.fast
            if fast is not None:
                entry = fast[index]
                grad = param.grad
                if entry is not None and grad is not None and not grad.requires_grad and not grad.is_sparse:
                    bucket, slot, view, scale = entry
                    seen = bucket.seen
                    if not seen[slot]:  # a second gradient is an error: the slow path raises it
                        step.hooks_fired = True
                        seen[slot] = True
                        bucket.grads[slot] = grad  # copy_back's target, and the non-finite check's input
                        if scale is None:
                            view.copy_(grad)
                        else:
                            torch.mul(grad, scale, out=view)
                        pending = step.pending
                        left = pending[bucket.index] - 1
                        pending[bucket.index] = left
                        if not left:
                            reducer.bucket_full(step, bucket.index)
                        return
        if reducer.expect_hooks:
            reducer.on_grad(index, param)
        elif reducer.usage.track_window:
            reducer.usage.used_in_window[index] = True  # no_sync micro-batch: synchronise this one later

    return hook
