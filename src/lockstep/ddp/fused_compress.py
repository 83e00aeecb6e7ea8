"""The fp16/bf16 compress hooks run by the reducer itself: the hook's result, bit for bit, with less work.

torch's DDP does the same for its built-in hooks (``_register_builtin_comm_hook(FP16_COMPRESS)`` runs
the hook's arithmetic in C++). Here it applies to any hook declared ``averages_in(dtype, ...)``
(lockstep's ``fp16_compress_hook`` / ``bf16_compress_hook``) and to torch's
``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``, when the hook's state names the
reducer's own group. Per bucket the arithmetic is the hook's: cast the local gradients to ``dtype``
(round to nearest), divide by the group's size in ``dtype``, all-reduce the sum, cast back. At 2 ranks
that is the hook's result bit for bit; at 3 or more, gloo's ring adds each element in an order set by
its place in the buffer, and the last bucket here carries one element more (the flag), so sums there may
round differently, as lockstep's path without a hook may against torch's (docs/differences-from-torch.md).

What it saves against calling the hook, per backward:
- the missing-gradient flag's own all-reduce (~0.5 ms at 2 ranks on gloo): a hook's buffer must be
  exactly the gradients, so the flag needs a collective of its own; here it rides, cast like the
  gradients, in the last bucket's spare element, as it does without a hook;
- on the common path (``copy_back``'s fast COPY case) one full-size float pass per bucket: the
  reduced copy goes straight into ``.grad`` instead of into the bucket and then into ``.grad``;
- per bucket, a GradBucket, two Future callbacks (each takes the GIL on the backend's thread) and
  the compressed copy: half the bucket's bytes (float32 gradients), which torch's hook allocates per
  bucket per step and holds until that bucket's all-reduce is done (its in-flight buckets' copies are
  at the step's peak). Here the bucket is cast into the first half of its own bytes (``narrow_in_place``):
  its float values are not read again before ``finish`` overwrites them with the average, so the copy
  costs no memory at all, and no allocation but a sixteenth of it for a moment (issue #30).

Not used with ``detect_nonfinite`` (its count is summed in the same spare element, and would not
survive the cast exactly): the hook is called then, as any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from lockstep.collectives.clean import all_reduce_sum_clean
from lockstep.comm_hooks.base import compressed_average_dtype, group_of
from lockstep.ddp.reducer_state import Bucket, slot_view

# The part of a cast in place that goes through a temporary: at least this many elements (32 KB of fp16,
# under glibc's mmap threshold), at least 1/16 of the tensor, so a cast takes at most ~5 passes.
HEAD_MIN_NUMEL = 16384
HEAD_FRACTION = 16


def wire_view(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``source``'s first bytes seen as ``source.numel()`` elements of ``dtype``, or None where they do not fit
    (``source`` not a contiguous 1-D real tensor at least as wide per element as ``dtype``)."""
    ratio, rest = divmod(source.element_size(), dtype.itemsize)
    if rest or ratio < 1 or source.dim() != 1 or not source.is_contiguous() or source.is_complex():
        return None
    return source.view(dtype)[: source.numel()]


def _head(numel: int) -> int:
    return min(numel, max(HEAD_MIN_NUMEL, -(-numel // HEAD_FRACTION)))


def narrow_in_place(source: torch.Tensor, wire: torch.Tensor) -> None:
    """``wire.copy_(source)`` where ``wire`` is ``wire_view(source, ...)``: the cast written over the bytes it reads.

    Element by element the cast is the one ``copy_`` does (round to nearest), so the bits are the same. With
    ``ratio`` = source bytes / wire bytes per element >= 2, writing wire elements [a, b) touches source elements
    below b / ratio, so chunks [a, ratio * a) in rising order only overwrite elements already read; the head
    [0, h) goes through a small temporary. Same width (fp16 <-> bf16, or the same dtype): one copy, each element
    over itself, as any elementwise in-place op.
    """
    numel = source.numel()
    ratio = source.element_size() // wire.element_size()
    if ratio == 1:
        wire.copy_(source)
        return
    head = _head(numel)
    first = source[:head].to(wire.dtype)  # read before anything is written
    start = head
    while start < numel:
        end = min(numel, start * ratio)
        wire[start:end].copy_(source[start:end])
        start = end
    wire[:head].copy_(first)


def widen_in_place(wire: torch.Tensor, target: torch.Tensor) -> None:
    """``target.copy_(wire)`` where ``wire`` is ``wire_view(target, ...)``: ``narrow_in_place`` backwards.
    Chunks [a, b) with b <= ratio * a in falling order: writing target elements [a, b) overwrites wire elements
    from ratio * a on, all read already; the head last, from a copy of it."""
    numel = target.numel()
    ratio = target.element_size() // wire.element_size()
    if ratio == 1:
        target.copy_(wire)
        return
    head = _head(numel)
    end = numel
    while end > head:
        start = max(head, -(-end // ratio))
        target[start:end].copy_(wire[start:end])
        end = start
    target[:head].copy_(wire[:head].clone())  # the clone: target's head overlaps it


@dataclass(frozen=True)
class FusedCompression:
    """A compress hook's average, run by the reducer: ``dtype`` on the wire, divided by ``world_size``."""

    dtype: torch.dtype
    world_size: int

    def launch(self, bucket: Bucket, last: bool, group: dist.ProcessGroup) -> Any:
        """Cast, divide and issue the bucket's all-reduce (the last bucket with its spare element, the flag)."""
        source = _source(bucket, last)
        wire = _wire(bucket, source, self.dtype)
        if wire.data_ptr() != source.data_ptr():
            wire.copy_(source)  # a buffer of its own (gradients narrower than ``dtype``)
        elif wire.dtype != source.dtype:
            narrow_in_place(source, wire)  # the cast ``buffer.to(dtype)`` does, over the bytes it reads
        wire.div_(self.world_size)  # in ``dtype``, after the cast: the hook's two roundings, not one
        return all_reduce_sum_clean(wire, group)

    def finish(self, bucket: Bucket, last: bool, into_grads: bool) -> None:
        """After the bucket's wait: the average back in float. ``into_grads`` (``copy_back``'s fast COPY path):
        straight into the gradients the hooks saw, and only the flag into the bucket (whose float values are
        not read again: ``copy_in`` writes every slot before the next launch)."""
        source = _source(bucket, last)
        wire = _wire(bucket, source, self.dtype)
        if into_grads and bucket.direct is None:
            torch._foreach_copy_(cast("list[torch.Tensor]", bucket.grads), bucket.compressed_views)  # all set here
            if last:
                bucket.buffer[-1:].copy_(wire[-1:])
        elif wire.data_ptr() != source.data_ptr():
            source.copy_(wire)
        elif wire.dtype != source.dtype:
            widen_in_place(wire, source)


def _source(bucket: Bucket, last: bool) -> torch.Tensor:
    """What the bucket sends: the last one its whole buffer (the spare element: the flag), a direct one the
    gradient itself (``copy_in``), any other its gradients."""
    if last:
        return bucket.buffer
    return bucket.flat if bucket.direct is None else bucket.direct


def _wire(bucket: Bucket, source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` tensor ``source`` is all-reduced in: its own first bytes (``wire_view``).

    The bucket's is kept on the bucket, with the parameters' views into it (``finish``'s copy into the
    gradients); a direct bucket's lies in this step's gradient and is not kept (it would keep that gradient
    alive). Only where the gradients are narrower than ``dtype`` (none of torch's float dtypes) is it a
    buffer of its own, kept between steps.
    """
    if source is bucket.direct:
        wire = wire_view(source, dtype)
        if wire is not None:
            return wire
    compressed = bucket.compressed
    if compressed is None or compressed.dtype != dtype:
        whole = bucket.buffer  # with the spare element: the other buckets send a prefix of it
        compressed = wire_view(whole, dtype)
        if compressed is None:
            compressed = torch.empty(whole.numel(), dtype=dtype, device=whole.device)
        bucket.compressed = compressed
        bucket.compressed_views = [slot_view(compressed, o, v) for o, v in zip(bucket.plan.offsets, bucket.views)]
    return compressed[: source.numel()]


def fused_compression(hook: Any, state: Any, group: dist.ProcessGroup) -> FusedCompression | None:
    """What the reducer runs in place of ``hook(state, bucket)``, or None where it must call the hook.

    Only where the hook would average over the reducer's own group (``state`` None or naming it):
    a hook given another group averages over that one, and is called.
    """
    dtype = compressed_average_dtype(hook)
    if dtype is None:
        return None
    try:
        hook_group = group_of(state)
    except TypeError:
        return None  # the hook will raise the same when called, naming the state
    world = dist.group.WORLD
    if (hook_group if hook_group is not None else world) != (group if group is not None else world):
        return None
    return FusedCompression(dtype, dist.get_world_size(group))
