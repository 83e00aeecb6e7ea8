"""The last step of a backward: the averaged gradients, from the bucket buffers into ``param.grad``."""

from __future__ import annotations

from typing import Sequence

import torch

from lockstep.ddp.reducer_state import Bucket


def copy_back(
    buckets: Sequence[Bucket],
    params: Sequence[torch.nn.Parameter],
    globally_used: list[bool] | None,
    gradient_as_bucket_view: bool,
    fast: bool,
) -> None:
    """Put each bucket's averages where the optimizer reads them.

    ``fast`` (no bucket views, no gradient carrying a graph, no missing gradient): one
    ``_foreach_copy_`` per bucket into the gradients the hooks saw, the common path. Otherwise per
    parameter: a view into the bucket (``gradient_as_bucket_view``), a clone where ``.grad`` was None,
    or a ``copy_`` that autograd records when the gradient carries a graph (``create_graph=True``).
    ``globally_used`` (find_unused_parameters): a parameter no rank used keeps its ``.grad`` as it
    was (None stays None), as torch does.
    """
    for bucket in buckets:
        if globally_used is None and fast:
            torch._foreach_copy_(bucket.grads, bucket.views)
            continue
        for i, grad, view in zip(bucket.plan.param_indices, bucket.grads, bucket.views):
            if globally_used is not None and not globally_used[i]:
                continue
            p = params[i]
            if gradient_as_bucket_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif grad is None or p.grad is None:
                p.grad = view.clone()
            else:
                grad.copy_(view)
