"""The first step of a bucket: a ready gradient, into its slot of the bucket's flat buffer.

Three modes, chosen by DDP's ``gradient_as_bucket_view``:

``COPY`` (False, torch's default): the local gradient is multiplied by 1/world size into the slot
(``torch.mul(out=)``: the scaling rides on the copy), and after the all-reduce ``copy_back`` copies
the average into the local gradient. Two passes over every gradient per step, as torch's DDP.

``ALIAS`` (None, lockstep's opt-in): the same fused scale-and-copy in, then ``param.grad`` becomes
the slot itself, so the all-reduce leaves the average where the optimizer reads it and nothing is
copied back: one pass instead of two (for the 10.5M-parameter MLP, 42 MB read and written less per
step), and after backward one model's worth of gradient memory less. A gradient that already is its
slot (``zero_grad(set_to_none=False)``, accumulation without ``zero_grad``) is scaled in place: still
one pass. The arithmetic is torch's (the same multiply by the reciprocal), so results stay
bit-identical to torch's DDP; what differs is that ``.grad`` aliases the bucket (docs/ddp.md).

Direct buckets (COPY mode, ``buckets.assign_buckets``' ``direct_min_bytes``): a large parameter's
bucket all-reduces its gradient where autograd left it: the gradient is scaled by 1/world size in
place and handed to the all-reduce as it is, so the average lands in ``param.grad`` with no copy in
and no copy back (for the 10.5M-parameter MLP, 32 of its 42 MB). ``.grad`` stays the tensor autograd
made, as with torch's default, and the values are bit-identical (the same multiply, the same sum).
A comm hook that issues its collectives up front (``comm_hooks.issues_collectives_up_front``: the
allreduce and fp16/bf16 hooks, lockstep's and torch's) gets the gradient itself as its bucket's buffer,
so its result lands in ``.grad``, again with no copy in or back. The bucket's own buffer is used
instead, as for any bucket, whenever that would not be safe: another comm hook (it may use the
buffer from a later callback); the non-finite check together with a hook, or where it reads the
local gradients after the all-reduce (world sizes that are no power of two); a gradient carrying a
graph, of another dtype or layout, or not contiguous (channels_last); a parameter with
post-accumulate-grad hooks other than DDP's (they would read a gradient in flight). A rank may copy
where another went direct: a bucket that is not the last sends only its gradients (``Reducer._issue``).

``VIEW`` (True): torch's ``gradient_as_bucket_view=True``: the local gradient is copied unscaled and
the whole bucket divided at launch (``Reducer._issue``).

Sparse buckets (any mode): the gradient of an ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``
is divided in place and all-reduced as the sparse tensor it is, as torch's reducer does
(``_sparse_in``); the backend's sparse all-reduce (gloo's) leaves the coalesced sum in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lockstep.ddp.reducer_state import Bucket
from lockstep.ddp.step import ALIAS, COPY, FLOAT32_SCALED, VIEW, Backward, StepPlan, reciprocal_f32


def copy_in(step: Backward, params: Sequence[torch.nn.Parameter], names: Sequence[str], index: int, bucket: Bucket,
            slot: int, grad: torch.Tensor | None, hooked: bool) -> None:
    """``grad`` (parameter ``index``'s local gradient, or None) into ``bucket``'s slot, as ``step.plan`` says;
    ``hooked``: from the parameter's own hook. Notes in ``step`` what ``copy_back`` must still do (``fixups``,
    ``graph_grads``).

    A parameter marked ready without its hook (unused, or missing at the end of backward) keeps
    its own ``.grad`` here: torch leaves it untouched where no rank used it, which only the status
    exchange at the end of backward tells.
    """
    plan = step.plan
    if not bucket.resident:  # let go of at the forward's start (``Bucket.release``): a fresh buffer now
        bucket.make_resident()
    bucket.grads[slot] = grad  # the local gradient, kept to the end of backward (the non-finite check reads it)
    if bucket.plan.sparse:
        _sparse_in(step, params[index], names[index], bucket, grad, hooked)
        return
    if grad is not None and grad.layout != torch.strided:
        raise RuntimeError(
            f"parameter {names[index]!r} got a {grad.layout} gradient where DistributedDataParallel expects a "
            "dense one: only the weights of nn.Embedding / nn.EmbeddingBag modules with sparse=True are expected "
            "to produce sparse gradients (as in torch's DDP); compute the gradient in such a module, or densify it"
        )
    view = bucket.views[slot]
    if grad is None:  # .grad is None (a hook that fires with no gradient reads .grad, as torch's)
        view.zero_()  # no local gradient: this rank contributes zero
        step.fixups += 1  # copy_back gives it the average where some rank used it, as torch
        return
    mode = plan.mode
    if bucket.plan.direct and hooked and mode == COPY and _direct_ok(plan, params[index], grad, view):
        # A comm hook gets the local gradient as its buffer, not divided (as torch's); otherwise it is
        # scaled in place, the one pass over it, with the non-finite check in that pass when it is on.
        if not plan.hooked and plan.nonfinite is not None:
            plan.nonfinite.scale_direct(grad, plan.divisor, index)
        elif not plan.hooked and plan.divisor != 1:
            grad.mul_(scale_for(plan.divisor, grad))
        # What the all-reduce (or the hook, as its buffer) gets: a flat alias, so .grad's own object is not in the work.
        bucket.direct = grad.detach().view(-1)
        return
    if grad.requires_grad:
        # backward(create_graph=True): the bucket takes a detached copy (an out= op cannot be
        # differentiated); copy_back puts the average into the graph-carrying grad with a recorded copy_.
        step.graph_grads = True
        grad = grad.detach()
        if mode == ALIAS:
            mode = COPY  # this slot as torch's default: copy_back's recorded copy_ (it is not fast now)
    if mode == VIEW:
        if grad.data_ptr() != view.data_ptr():
            # A fresh grad (first step, or zero_grad(set_to_none=True)): one copy, then alias, and let go of
            # the fresh one now, as torch's reducer does (``_let_go``).
            view.copy_(grad)
            params[index].grad = view
            _let_go(plan, bucket, slot, view)
        return
    # The average's scaling fused into the copy. A multiply by the reciprocal, as torch's reducer does
    # (bit-equal to it at any world size) and cheaper than a divide. A comm hook gets the plain local
    # gradients, as in torch.
    scale = None if plan.hooked else scale_for(plan.divisor, grad)
    if mode == ALIAS and grad.data_ptr() == view.data_ptr():
        if not hooked:
            # Its .grad must survive as it is if no rank used it: a copy of the local values takes its
            # place (one clone; the next step finds .grad no longer aliased and copies as usual).
            local = grad.clone()
            params[index].grad = local
            bucket.grads[slot] = local
            step.fixups += 1
        if scale is not None:
            view.mul_(scale)
        return
    if scale is None:
        view.copy_(grad)
    else:
        torch.mul(grad, scale, out=view)
    if mode == ALIAS:
        if hooked:
            params[index].grad = view  # the all-reduce will leave the average here: no copy back
            _let_go(plan, bucket, slot, view)
        else:
            step.fixups += 1


def _let_go(plan: StepPlan, bucket: Bucket, slot: int, view: torch.Tensor) -> None:
    """``.grad`` has just become its slot: the bucket stops holding the gradient autograd made, so it is freed
    now, not at the end of backward. Held to then, those fresh gradients (every one after ``zero_grad()``'s
    set_to_none) were one model's worth of memory on top of the buckets at the peak (issue #30); torch's reducer
    re-points ``.grad`` at the bucket view in its hook and keeps nothing. The slot stands in for it
    (``copy_back`` and the non-finite check read an aliased entry as "averaged in place"), except where the
    non-finite check is on, which may read the local values after the all-reduce to name an offender."""
    if plan.nonfinite is None:
        bucket.grads[slot] = view


def _sparse_in(step: Backward, param: torch.nn.Parameter, name: str, bucket: Bucket, grad: torch.Tensor | None,
               hooked: bool) -> None:
    """A sparse bucket's gradient, divided in place by the divisor (torch's reducer divides it so: the
    all-reduced sum is then the average); a comm hook gets it undivided, as torch's.

    Where this rank has no gradient of its own it sends a stand-in instead (``copy_back`` hands the
    average to ``.grad`` only where some rank used the parameter): an empty sparse tensor where
    ``.grad`` is None, else a divided copy of the ``.grad`` left from earlier (marked without its hook:
    unused here, or missing), so that tensor is not changed in place. Unlike torch's DDP, which raises
    "Expected sparse gradient to be defined." where a rank did not use a sparse parameter under
    find_unused_parameters=True.
    """
    if grad is not None and grad.layout != torch.sparse_coo:
        raise RuntimeError(
            f"parameter {name!r} belongs to a module with sparse=True, so DistributedDataParallel "
            f"expects a sparse gradient, and it got a {grad.layout} one"
        )
    if grad is None:
        grad = empty_sparse_like(param)
        step.fixups += 1
    elif not hooked or grad.requires_grad:
        grad = grad.detach().clone()
        step.fixups += 1
    if not step.plan.hooked and step.plan.divisor != 1:
        grad.div_(step.plan.divisor)
    bucket.sparse = grad


def _direct_ok(plan: StepPlan, param: torch.nn.Parameter, grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether this gradient can be all-reduced where it is (the module docstring lists why not)."""
    if grad.requires_grad:
        return False
    if plan.hooked and (plan.nonfinite is not None or plan.one_in_flight):
        return False  # a hook that may keep the buffer past its call (from a callback), or checked before it
    if plan.nonfinite is not None and not plan.nonfinite.takes_direct(grad, plan.divisor):
        return False  # the check reads the local gradients after the all-reduce here
    if (
        grad.dtype != view.dtype
        or grad.device != view.device
        or grad.layout != torch.strided
        or not grad.is_contiguous()
    ):
        return False
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return hooks is not None and len(hooks) == 1


def unalias_grads(buckets: Sequence[Bucket], mode: str) -> None:
    """Before a joined rank's shadow round zeroes and reduces the buckets: a ``.grad`` that is a slot
    becomes its own copy, so the joined rank's gradients stay as they were, as torch's (whose joined
    rank reduces zero tensors of its own). One clone per parameter, once per join."""
    if mode == COPY:
        return
    for bucket in buckets:
        for p, view in zip(bucket.params, bucket.views):
            grad = p.grad
            if grad is not None and grad.data_ptr() == view.data_ptr():
                p.grad = view.clone()


def zero_for_shadow(buckets: Sequence[Bucket], mode: str) -> None:
    """A joined rank's buckets for its shadow round: each ``.grad`` that is a slot first gets its own copy
    (``unalias_grads``: the order matters), then zeros, and an empty sparse gradient in a sparse bucket."""
    unalias_grads(buckets, mode)
    for bucket in buckets:
        bucket.make_resident()  # let go of at a forward's start (``Bucket.release``): the zeros are sent
        bucket.buffer.zero_()
        if bucket.plan.sparse:
            bucket.sparse = empty_sparse_like(bucket.params[0])


def empty_sparse_like(param: torch.Tensor) -> torch.Tensor:
    """No gradient for an embedding table, as the sparse tensor its backward makes (1 sparse dimension, the rest
    dense), so a rank with none takes part in the sparse all-reduce and adds nothing."""
    indices = torch.empty((1, 0), dtype=torch.long, device=param.device)
    values = torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False, is_coalesced=True)


def scale_for(divisor: int, grad: torch.Tensor) -> Any:
    """1/divisor for ``grad``: the cached float32 tensor for float32/float16/bfloat16 CPU gradients (``step``'s
    ``reciprocal_f32``), else a float (a float32 reciprocal would round float64 and other dtypes differently)."""
    if grad.dtype in FLOAT32_SCALED and grad.is_cpu:
        return reciprocal_f32(divisor)
    return 1.0 / divisor
