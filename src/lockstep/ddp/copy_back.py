"""The last step of a backward: the averaged gradients from the bucket buffers into ``param.grad`` (the waits, and the
common path's copy right after each, are the strategy's: ``strategy.wait_bucket``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from lockstep.ddp.reducer_state import Bucket
from lockstep.ddp.step import ALIAS, COPY, VIEW


def copy_back(
    buckets: Sequence[Bucket],
    params: Sequence[torch.nn.Parameter],
    globally_used: list[bool] | None,
    mode: str,
    fast: bool,
) -> None:
    """Put each bucket's averages where the optimizer reads them (``mode``: ``copy_in``'s).

    ``fast`` (no bucket views, no gradient carrying a graph, no missing gradient, no slot that
    ``copy_in`` left for here): in ALIAS mode nothing at all, every ``.grad`` already is its averaged
    slot; in COPY mode one ``_foreach_copy_`` per bucket into the gradients the hooks saw. Otherwise
    per parameter: its slot (ALIAS, VIEW), a clone where ``.grad`` was None (COPY), or a ``copy_``
    that autograd records when the gradient carries a graph (``create_graph=True``, any mode but VIEW).
    ``globally_used`` (find_unused_parameters): a parameter no rank used keeps its ``.grad`` as it
    was (None stays None), as torch does.
    """
    if fast and mode == ALIAS:
        return
    for bucket in buckets:
        if bucket.direct is not None:
            continue  # all-reduced in its gradient: the average is in .grad already (``copy_in``)
        if bucket.plan.sparse:
            _sparse_back(bucket, params, globally_used)
            continue
        if globally_used is None and fast and mode == COPY:
            torch._foreach_copy_(cast("list[torch.Tensor]", bucket.grads), bucket.views)  # fast: every one set
            continue
        for i, grad, view in zip(bucket.plan.param_indices, bucket.grads, bucket.views):
            if globally_used is not None and not globally_used[i]:
                continue
            p = params[i]
            if mode == VIEW:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif mode == ALIAS and (grad is None or not grad.requires_grad):
                p.grad = view  # a no-op where the hook made it so already
            elif grad is None or p.grad is None:
                p.grad = view.clone()
            else:
                grad.copy_(view)


def _sparse_back(bucket: Bucket, params: Sequence[torch.nn.Parameter], globally_used: list[bool] | None) -> None:
    """A sparse bucket's average (all-reduced in place, ``copy_in``) into ``.grad`` where it is a stand-in.
    ``.grad`` itself was all-reduced where this rank had a gradient; a parameter no rank used keeps its ``.grad``."""
    i = bucket.plan.param_indices[0]
    p = params[i]
    grad = p.grad
    if grad is bucket.sparse or (globally_used is not None and not globally_used[i]):
        return
    if grad is None or grad.requires_grad or not grad.is_sparse:
        p.grad = bucket.sparse
    else:
        grad.copy_(cast(torch.Tensor, bucket.sparse))  # copy_in set it
