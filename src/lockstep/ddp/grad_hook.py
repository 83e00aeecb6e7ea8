"""The per-parameter hook: autograd calls it once per parameter per backward, so its common path is short.

torch's DDP runs this step in C++; here it is a Python call per parameter, and on a model of many
small tensors that call is most of what lockstep spends beyond torch (the 51-tensor bench
transformer: ~25 us a parameter through ``Reducer._on_grad``, ``_mark_ready`` and ``_copy_in``, each
re-checking a mode that cannot change inside a backward). So at the start of each synchronised
backward the reducer decides once whether this backward is on the common path (``fast_table``):
copies (torch's default ``gradient_as_bucket_view=False``), no unused-parameter tracking or static
graph, buckets already rebuilt, no test event log. Then each hook does only what that path needs (mark
the slot, one fused scale-and-copy, count down the bucket) with its bucket, slot, view and scale
looked up in one list. Anything off that path (no gradient, a gradient twice, one carrying a graph or
sparse, a direct or sparse bucket) goes through ``Reducer._on_grad`` as before, so behaviour is the same by construction:
the fast path is a subset of the slow one's steps, in the same order, for the cases it takes.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from lockstep.ddp.copy_in import COPY


def fast_table(reducer: Any) -> list | None:
    """This backward's ``(bucket, slot, view, scale)`` per parameter index if it is on the common path, else None
    (every hook goes slow); an entry is None where the slow path must run anyway (a direct bucket).

    Built once per layout, comm hook and divisor (a list of tuples), so a backward pays one key compare.
    """
    if not reducer.expect_hooks or reducer.grad_mode != COPY or reducer.usage.active:
        return None
    if reducer._observed_order is not None or reducer.events is not None:
        return None  # the first backward records the order for the rebuild; tests record events
    key = (reducer.layout_version, reducer.divisor, reducer.comm_hook is None)
    cached = reducer._fast_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    table: list = [None] * len(reducer.params)
    for bucket in reducer.buckets:
        if bucket.plan.direct or bucket.plan.sparse:
            continue  # large and rare (copy_in's checks decide per backward whether it goes direct), or sparse
        for slot, (i, view) in enumerate(zip(bucket.plan.param_indices, bucket.views)):
            # A comm hook gets the local gradients as they are (as torch's); otherwise the 1/world-size
            # scaling rides on the copy (``copy_in``: the same multiply, so the same bits).
            scale = None if reducer.comm_hook is not None else reducer._scale_for(view)
            table[i] = (bucket, slot, view, scale)
    reducer._fast_cache = (key, table)
    return table


def make_hook(reducer_ref: weakref.ref, index: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``index``'s post-accumulate-grad hook; holds the reducer weakly (parameters outlive a dropped DDP)."""

    def hook(param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is None:
            return
        fast = reducer._fast
        if fast is not None:
            entry = fast[index]
            grad = param.grad
            if entry is not None and grad is not None and not grad.requires_grad and not grad.is_sparse:
                bucket, slot, view, scale = entry
                seen = bucket.seen
                if not seen[slot]:  # a second gradient is an error: the slow path raises it
                    reducer._hooks_fired = True
                    seen[slot] = True
                    bucket.grads[slot] = grad  # copy_back's target, and the non-finite check's input
                    if scale is None:
                        view.copy_(grad)
                    else:
                        torch.mul(grad, scale, out=view)
                    pending = reducer._pending
                    left = pending[bucket.index] - 1
                    pending[bucket.index] = left
                    if not left:
                        reducer._bucket_full(bucket.index)
                    return
        if reducer.expect_hooks:
            reducer._on_grad(index, param)
        elif reducer.usage.track_window:
            reducer.usage.used_in_window[index] = True  # no_sync micro-batch: synchronise this one later

    return hook
