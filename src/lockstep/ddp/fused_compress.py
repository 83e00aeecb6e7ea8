"""The fp16/bf16 compress hooks run by the reducer itself: the hook's result, bit for bit, with less work.

torch's DDP does the same for its built-in hooks (``_register_builtin_comm_hook(FP16_COMPRESS)`` runs
the hook's arithmetic in C++). Here it applies to any hook declared ``averages_in(dtype, ...)``
(lockstep's ``fp16_compress_hook`` / ``bf16_compress_hook``) and to torch's
``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``, when the hook's state names the
reducer's own group. Per bucket the arithmetic is the hook's: cast the local gradients to ``dtype``
(round to nearest), divide by the group's size in ``dtype``, all-reduce the sum, cast back. At 2 ranks
that is the hook's result bit for bit; at 3 or more, gloo's ring adds each element in an order set by
its place in the buffer, and the last bucket here carries one element more (the flag), so sums there may
round differently, as lockstep's path without a hook may against torch's (README, "Differences").

What it saves against calling the hook, per backward:
- the missing-gradient flag's own all-reduce (~0.5 ms at 2 ranks on gloo): a hook's buffer must be
  exactly the gradients, so the flag needs a collective of its own; here it rides, cast like the
  gradients, in the last bucket's spare element, as it does without a hook;
- on the common path (``copy_back``'s fast COPY case) one full-size float pass per bucket: the
  reduced copy goes straight into ``.grad`` instead of into the bucket and then into ``.grad``;
- per bucket, a GradBucket, two Future callbacks (each takes the GIL on the backend's thread) and
  the compressed copy's allocation: each bucket keeps its compressed buffer (half the bucket's bytes
  for fp16/bf16 float32 gradients), until the buckets are rebuilt.

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


@dataclass(frozen=True)
class FusedCompression:
    """A compress hook's average, run by the reducer: ``dtype`` on the wire, divided by ``world_size``."""

    dtype: torch.dtype
    world_size: int

    def launch(self, bucket: Bucket, last: bool, group: dist.ProcessGroup) -> Any:
        """Cast, divide and issue the bucket's all-reduce (the last bucket with its spare element, the flag)."""
        source = bucket.buffer if last else (bucket.flat if bucket.direct is None else bucket.direct)
        compressed = bucket.compressed
        if compressed is None or compressed.numel() != source.numel() or compressed.dtype != self.dtype:
            compressed = bucket.compressed = torch.empty(source.numel(), dtype=self.dtype, device=source.device)
            bucket.compressed_views = [slot_view(compressed, o, v) for o, v in zip(bucket.plan.offsets, bucket.views)]
        compressed.copy_(source)  # the cast ``buffer.to(dtype)`` does, into a buffer kept from the last step
        compressed.div_(self.world_size)  # in ``dtype``, after the cast: the hook's two roundings, not one
        return all_reduce_sum_clean(compressed, group)

    @staticmethod
    def finish(bucket: Bucket, last: bool, into_grads: bool) -> None:
        """After the bucket's wait: the average back in float. ``into_grads`` (``copy_back``'s fast COPY path):
        straight into the gradients the hooks saw, and only the flag into the bucket."""
        compressed = bucket.compressed
        assert compressed is not None  # launch() made it
        if into_grads and bucket.direct is None:
            torch._foreach_copy_(cast("list[torch.Tensor]", bucket.grads), bucket.compressed_views)  # all set here
            if last:
                bucket.buffer[-1:].copy_(compressed[-1:])
        elif last:
            bucket.buffer.copy_(compressed)
        else:
            (bucket.flat if bucket.direct is None else bucket.direct).copy_(compressed.view(-1))


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
