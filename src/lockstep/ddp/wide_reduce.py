"""A low-precision model's gradients summed in a wider dtype: each bucket cast up, all-reduced, cast back.

A bf16 model's buckets are bf16, so torch's DDP (and lockstep's default) sum the ranks' gradients in bf16: each of
the ring's additions rounds to bf16's 8-bit mantissa, N - 1 roundings at N ranks. FSDP's
``MixedPrecision(reduce_dtype=torch.float32)`` sums in fp32 instead; ``reduce_in(ddp, torch.float32)`` does the same
for the DDP: at a bucket's launch its contents (each gradient already scaled by 1/world size, as always) are cast into
a buffer of ``dtype`` and all-reduced there; at the wait the sum is cast back into the bucket, once, and goes into
``.grad`` as usual. At 2 ranks the two agree bit for bit (one addition, one rounding either way); from 3 on the wide
sum is the exact sum rounded once. Costs: the wire carries ``dtype``'s bytes (2 x for bf16 -> fp32), one cast each way
per bucket, and one ``dtype`` buffer per bucket in flight. Parameters already in ``dtype`` go as they are.

It is also the smallest reduction strategy (docs/architecture.md): a subclass of ``strategy.AllReduce`` bound with
``Reducer.bind``, changing only what its launch runs on (``set_collectives``: the group seen through ``_WideGroup``);
the reducer and the other strategies do not change. A comm hook sets what goes on the wire itself, so it is refused;
across nodes the buckets go flat (the hierarchy's stages are not cast).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lockstep.ddp.strategy import AllReduce


class _CastBack:
    """The work of an all-reduce run in the wide buffer: ``wait`` casts the sum back into the bucket's tensor."""

    __slots__ = ("work", "wide", "target")

    def __init__(self, work: dist.Work, wide: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.target = work, target
        self.wide: torch.Tensor | None = wide

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        if self.wide is not None:
            self.target.copy_(self.wide)
            self.wide = None  # cast back once, however often it is waited for; the buffer goes with it
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _WideGroup:
    """The group as the strategy's launch sees it: ``allreduce`` of one tensor runs on a copy of it in ``dtype``."""

    def __init__(self, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
        self.group, self.dtype = group, dtype

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        (tensor,) = tensors
        if tensor.dtype == self.dtype or not tensor.is_floating_point():
            return self.group.allreduce(tensors, opts)
        wide = tensor.to(self.dtype)
        return _CastBack(self.group.allreduce([wide], opts), wide, tensor)


class WideReduce(AllReduce):
    """DDP's reduction with every floating bucket summed in ``dtype`` (``reduce_in``)."""

    name = "wide all-reduce"

    def __init__(self, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"reduce_in: dtype must be a floating dtype (torch.float32, torch.float64), got {dtype}")
        self.dtype = dtype

    def set_collectives(self, group: dist.ProcessGroup, comm_hook: Any, comm_hook_state: Any,
                        hierarchy: Any) -> AllReduce:
        self.take_hook(comm_hook, None)
        return super().set_collectives(_WideGroup(group, self.dtype), None, None, None)  # type: ignore[arg-type]

    def take_hook(self, hook: Any, fused: Any) -> None:
        if hook is not None:
            raise ValueError(f"reduce_in: a comm hook ({getattr(hook, '__name__', type(hook).__name__)}) decides what "
                             "goes on the wire itself; use one or the other")


def reduce_in(ddp: Any, dtype: torch.dtype = torch.float32) -> None:
    """Sum ``ddp``'s gradients across ranks in ``dtype`` (FSDP's ``reduce_dtype``): for a bf16 or fp16 model. Once,
    before the first forward or between steps; not with a comm hook, ZeRO-2 or the overlapped step (one strategy a
    DDP: ``Reducer.bind`` refuses a second in one line)."""
    ddp.reducer.bind(WideReduce(dtype), "reduce_in")
