"""Non-finite gradients: find the rank and the parameter that produced a NaN or Inf before it is averaged.

An all-reduce spreads one rank's NaN to every rank in the same step, and from then on nobody can tell
where it came from. ``DDP(detect_nonfinite=True)`` checks each bucket's local gradients just before its
collective is issued: one sum over the bucket (a NaN or Inf anywhere makes the sum non-finite), about
one extra read of the gradients. The verdict rides on a collective every rank issues anyway: the last
bucket's spare element, which already carries the missing-gradient flag, gets ``(world_size + 1)`` times
this rank's count of bad buckets added, so the sum over ranks tells every rank, at the end of backward,
whether any rank saw a non-finite gradient. Only then a small extra round (an all-gather of each rank's
offending parameters) names them, and every rank raises the same error before the averaged gradients
reach ``.grad`` (so no optimizer step applies them).

Cost: on CPU one host read of the sum per bucket (free there). On CUDA no host sync is added: the flags
stay on the device and are summed into the spare element by device ops; the end of backward reads that
element anyway (the missing-gradient flag), and only on a flagged step are the offenders read back.
With a comm hook the spare element is not reduced, so the count goes in one extra 4-byte all-reduce at the
end of backward (a host sync on CUDA).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist


class NonfiniteGradientError(RuntimeError):
    """Raised on every rank when some rank's local gradient held a NaN or Inf."""


class NonfiniteCheck:
    """Per-bucket finiteness of the local gradients, agreed across ranks through the last bucket's spare element."""

    def __init__(self, names: Sequence[str], group: dist.ProcessGroup):
        self.names = list(names)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.scale = float(self.world_size + 1)  # missing-gradient flags sum to <= world_size: this keeps them apart
        self.reset()

    def reset(self) -> None:
        self._count: Any = 0  # this rank's bad buckets this backward (an int, or a device tensor on CUDA)
        self._offenders: list[tuple[str, int, int, int]] = []  # (name, nan count, inf count, numel), CPU only
        self._device_flags: dict[int, torch.Tensor] = {}  # bucket index -> device bool (CUDA)

    def check_bucket(self, bucket: Any, param_indices: Sequence[int]) -> None:
        """Before the bucket's collective: does this rank's part hold a NaN or Inf?"""
        flat = bucket.flat
        if flat.numel() == 0:
            return
        # One pass. fp16/bf16 are summed in float32, where a sum of finite gradients cannot overflow.
        total = flat.sum(dtype=torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None)
        if flat.device.type == "cpu":
            if math.isfinite(total.item()):  # a host read: free on CPU
                return
            found = self._find(bucket.views, param_indices)
            if found:  # an all-finite bucket whose sum overflowed is not an error
                self._offenders += found
                self._count += 1
            return
        bad = ~torch.isfinite(total)  # stays on the device: no sync on the step's path
        self._device_flags[bucket.index] = bad
        self._count = self._count + bad.to(flat.dtype)

    def _find(self, views: Sequence[torch.Tensor], param_indices: Sequence[int]) -> list[tuple[str, int, int, int]]:
        found = []
        for i, view in zip(param_indices, views):
            finite = torch.isfinite(view)
            if not bool(finite.all()):
                nans = int(torch.isnan(view).sum())
                found.append((self.names[i], nans, int((~finite).sum()) - nans, view.numel()))
        return found

    def add_flag(self, buffer: torch.Tensor) -> None:
        """Into the last bucket's spare element, after its missing-gradient flag was written, before it is issued."""
        if isinstance(self._count, torch.Tensor):
            buffer[-1:].add_(self._count * self.scale)  # device ops: no sync
        elif self._count:
            buffer[-1] += self._count * self.scale

    def after_wait(self, buckets: Sequence[Any], comm_hook: bool) -> None:
        """End of backward, every rank, after the waits and before the status exchange: raise if any rank was bad."""
        try:
            if comm_hook:
                count = torch.tensor([float(self._count)], dtype=torch.float32)
                if dist.get_backend(self.group) == "nccl":
                    count = count.to(buckets[-1].buffer.device)
                dist.all_reduce(count, group=self.group)
                total_bad = int(round(count.item()))
            else:
                spare = buckets[-1].buffer[-1:]
                value = int(round(spare.item()))  # the read the status exchange does anyway
                total_bad = value // int(self.scale)
                if total_bad:
                    spare.sub_(total_bad * self.scale)  # leave the missing-gradient count for the status exchange
            if total_bad:
                self._raise(buckets)
        finally:
            self.reset()

    def _raise(self, buckets: Sequence[Any]) -> None:
        mine = list(self._offenders)
        for index, flag in self._device_flags.items():  # CUDA: find them now (a flagged step only)
            if bool(flag.item()):
                bucket = buckets[index]
                grads = [g if g is not None and g.data_ptr() != v.data_ptr() else None for g, v in zip(bucket.grads, bucket.views)]
                if all(g is not None for g in grads):  # the local gradients, untouched by the all-reduce
                    mine += self._find([g.detach() for g in grads], bucket.plan.param_indices)
                else:  # gradient_as_bucket_view: the local values were averaged in place
                    mine.append((" / ".join(self.names[i] for i in bucket.plan.param_indices[:8]), -1, -1, bucket.flat.numel()))
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (dist.get_rank(), mine), group=self.group)
        order = {name: i for i, name in enumerate(self.names)}
        parts = []
        for rank, found in gathered:
            if not found:
                continue
            found = sorted(found, key=lambda f: order.get(f[0], -1))  # registration order: forward's order
            shown = [f"{name!r} ({'?' if nans < 0 else f'{nans} NaN, {infs} Inf of {numel}'})" for name, nans, infs, numel in found[:4]]
            more = f" and {len(found) - 4} more" if len(found) > 4 else ""
            parts.append(f"rank {rank}: {len(found)} of {len(self.names)} parameters, {', '.join(shown)}{more}")
        if not parts:
            return  # every flagged sum had overflowed on finite values
        first_rank = next(rank for rank, found in gathered if found)
        raise NonfiniteGradientError(
            f"non-finite gradient on rank {first_rank}, caught before any rank's optimizer could apply it: {'; '.join(parts)}. "
            "Every rank raises here, so no optimizer step runs. When every gradient is non-finite, the loss was "
            "(look at that rank's inputs and loss for this step); when a few are, the last of them in the "
            "model's order is where backward first produced one. Pass detect_nonfinite=False to turn the check off."
        )
