"""Non-finite gradients: find the rank and the parameter that produced a NaN or Inf before it is averaged.

An all-reduce spreads one rank's NaN to every rank in the same step, and from then on nobody can tell
where it came from. ``DDP(detect_nonfinite=True)`` catches it and names it; how depends on where the
local values still exist.

The common path (CPU, no comm hook, gradients copied, a world size that is a power of two, 2 above
all): each bucket is checked before its all-reduce and the verdict rides on a collective every rank
issues anyway, so the check adds no round trip. A bucket of copies is summed once at its launch (a
NaN or Inf anywhere makes the sum non-finite; a sum that overflowed on large finite values is looked
at element by element before it counts); a direct bucket (``ddp.copy_in``: a large gradient
all-reduced where it is) is checked in the pass that scales it by 1/world_size, one
``_amp_foreach_non_finite_check_and_unscale_`` instead of a multiply (bit-identical: the reciprocal of
a power of two is exact). The offenders are named at once, from the local values. The count goes
into the last bucket's spare element, below. At such a world size an average of finite gradients
cannot overflow: each is scaled exactly, and at 2 ranks the one addition of two halves is at most the
dtype's largest value; at 4, 8, ... a ring sum would have to land within half an ulp of it.

At other world sizes (3, 5, 6, ...) the check reads the *averaged* buckets after their all-reduces,
where an overflowed average shows (1/3 is rounded, and three thirds of fp16's largest value overflow).
A NaN or Inf in any rank's local gradient survives the sum (NaN + x is NaN, Inf + finite is Inf,
Inf - Inf is NaN) and the scaling, so the average is non-finite wherever some rank's gradient was;
and the average is the same on every rank, so the ranks split the reading: rank r sums only its
1/world_size slice of each bucket, and one all-reduce of a few int32 flags (one per bucket) tells
every rank whether any slice was bad. Only on a flagged step each rank looks at its own local
gradients, still held (untouched by the all-reduce) by the buckets until the copy back, to name the
offenders. Direct buckets copy there, as without the check.

Where the local values are gone after the all-reduce, they are checked before it too, and the verdict rides
on a collective every rank issues anyway: the last bucket's spare element, which already carries the
missing-gradient flag, gets ``(world_size + 1)`` times this rank's count of bad buckets added, so the sum
over ranks tells every rank, at the end of backward, whether any rank saw a non-finite gradient:

- ``gradient_as_bucket_view=True`` (the gradients are averaged in place): the check rides in the
  pass that divides the bucket by the world size, one ``_amp_foreach_non_finite_check_and_unscale_``
  (a multiply by the reciprocal, bit-identical to the divide when the world size is a power of two)
  instead of a divide; at other world sizes a sum before the divide.
- CUDA: a sum per bucket whose flag stays on the device and is added into the spare element by device
  ops, so no host sync is added (the end of backward reads that element anyway, the missing-gradient
  flag); only on a flagged step are the offenders read back. A sum that overflowed on finite values
  is not an error there.
- A comm hook: a sum per bucket before the hook; the spare element is not reduced, so the count goes
  in one extra 4-byte all-reduce at the end of backward (a host sync on CUDA).

Then a small extra round (an all-gather of each rank's offending parameters) names them, and every
rank raises the same error before the averaged gradients reach ``.grad`` (so no optimizer step applies
them).

A non-finite average of finite local gradients (the all-reduce's sum overflowed: fp16 gradients near
65504 on three ranks, say) is caught where the average is read, at world sizes that are not a power of
two, and raises ``NonfiniteGradientError`` naming the parameters whose average is non-finite. Where
only the local values are read (powers of two, bucket views, comm hooks, CUDA) it is not: at a power
of two it cannot happen (above), elsewhere it is accepted, as torch's DDP accepts it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.collectives.clean import launch_clean

_FUSABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # what the fused check-and-scale takes


class NonfiniteGradientError(RuntimeError):
    """Raised on every rank when some rank's local gradient held a NaN or Inf, or their average overflowed.

    ``step``: the synchronised backward it was caught in, counted from 1 by the DDP (None when not known);
    ``detail``: the message without its "at step N (...): " prefix, for a caller that names the step its own
    way (the Trainer: optimizer step, epoch and batch)."""

    def __init__(self, message: str, step: int | None = None, detail: str | None = None):
        super().__init__(message)
        self.step, self.detail = step, detail if detail is not None else message


class NonfiniteCheck:
    """Finiteness of the gradients of each backward, agreed across ranks (see the module docstring)."""

    def __init__(self, names: Sequence[str], group: dist.ProcessGroup, bucket_view: bool = False):
        self.names = list(names)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.bucket_view = bucket_view  # gradient_as_bucket_view: the local values are averaged in place
        # A power of two (1, 2, 4, ...): checked before the all-reduces, the verdict in the last bucket's spare element.
        self.pre_launch = self.world_size & (self.world_size - 1) == 0
        self.scale = float(self.world_size + 1)  # missing-gradient flags sum to <= world_size: this keeps them apart
        self.last_work: Any = None  # the flags' all-reduce of the last backward, kept as the buckets' works are
        self._found = torch.zeros(1)  # the fused check's found-inf flag (CPU)
        self._inv: dict[int, torch.Tensor] = {}  # divisor -> 1 / divisor, as the fused check takes it
        # synchronised backwards checked (after_wait runs once per each on every rank, a joined rank's shadows
        # included): the error's step, the same on every rank
        self.backwards = 0
        self.reset()

    def reset(self) -> None:
        self._count: Any = 0  # this rank's bad buckets this backward (an int, or a device tensor on CUDA)
        self._checked: set[int] = set()  # buckets checked this backward (``check_ahead`` may come before the launch)
        self._offenders: list[tuple[str, int, int, int]] = []  # (name, nan count, inf count, numel), CPU only
        self._device_flags: dict[int, torch.Tensor] = {}  # bucket index -> device bool (CUDA)
        self._sparse_bad: dict[int, list] = {}  # sparse bucket index -> this rank's offenders in it (``check_sparse``)

    def after_reduce(self, tensor: torch.Tensor, comm_hook: bool) -> bool:
        """The common path, checked after the all-reduce on the average: a CPU bucket, no hook, copied gradients."""
        return not (comm_hook or self.bucket_view or self.pre_launch) and tensor.device.type == "cpu"

    def takes_direct(self, grad: torch.Tensor, divisor: int) -> bool:
        """Whether a direct bucket (``ddp.copy_in``) may go direct under this check: ``scale_direct`` takes it."""
        return (self.pre_launch and not self.bucket_view and grad.device.type == "cpu" and grad.dtype in _FUSABLE
                and divisor & (divisor - 1) == 0)

    def scale_direct(self, grad: torch.Tensor, divisor: int, index: int) -> None:
        """A direct bucket's gradient, after ``takes_direct``: scaled by 1/divisor in place with the check in the
        same pass (bit-identical to the multiply: the reciprocal of a power of two is exact), the offender noted."""
        inv = self._inv.get(divisor)
        if inv is None:
            inv = self._inv[divisor] = torch.tensor([1.0 / divisor])
        self._found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([grad], self._found, inv)
        if self._found.item():  # a host read: free on CPU
            self._note(self._find([grad], [index]))

    def check_bucket(self, bucket: Any, divisor: int = 1, comm_hook: bool = False) -> bool:
        """Before the bucket's collective. True when it also divided the bucket by ``divisor`` (bucket view)."""
        if bucket.index in self._checked:
            return False  # ``check_ahead`` did (never under bucket views: nothing divided)
        self._checked.add(bucket.index)
        flat = bucket.flat
        if bucket.plan.sparse:
            self.check_sparse(bucket)
            return False
        if bucket.direct is not None:
            return False  # checked as it was scaled (``scale_direct``)
        if flat.numel() == 0 or self.after_reduce(flat, comm_hook):
            return False  # nothing here: the average is read at the end of backward
        if (self.bucket_view and not comm_hook and flat.device.type == "cpu" and flat.dtype in _FUSABLE
                and divisor > 1 and divisor & (divisor - 1) == 0):
            inv = self._inv.get(divisor)
            if inv is None:
                inv = self._inv[divisor] = torch.tensor([1.0 / divisor])
            self._found.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_([flat], self._found, inv)  # the divide, checked
            if self._found.item():  # scaled by a power of two, the NaN and Inf are where they were
                self._note(self._find(bucket.views, bucket.plan.param_indices))
            return True
        # One pass. fp16/bf16 are summed in float32, where a sum of finite gradients cannot overflow.
        total = _sum(flat)
        if flat.device.type == "cpu":
            if not math.isfinite(total.item()):  # a host read: free on CPU
                self._note(self._find(bucket.views, bucket.plan.param_indices))  # none: the sum overflowed
            return False
        bad = ~torch.isfinite(total)  # stays on the device: no sync on the step's path
        self._device_flags[bucket.index] = bad
        self._count = self._count + bad.to(flat.dtype)
        return False

    def check_ahead(self, buckets: Sequence[Any], divisor: int = 1, comm_hook: bool = False) -> None:
        """Check ``buckets`` now, before their launch: the overlapped step (``ddp.overlap_step``) launches the last
        bucket, whose spare element carries the verdict, ahead of buckets launched later in its sequence."""
        for bucket in buckets:
            self.check_bucket(bucket, divisor, comm_hook)

    def check_sparse(self, bucket: Any) -> None:
        """A sparse bucket's gradient (``ddp.copy_in``), before its collective and at every world size: its values
        are all-reduced in place, so the local ones exist only now. One sum of the values (a host read; a
        debugging mode), the offender noted; at world sizes that are not a power of two its verdict is the
        bucket's flag in the end-of-backward all-reduce (``after_wait``)."""
        values = bucket.sparse._values()
        if values.numel() and not math.isfinite(_sum(values).item()):
            found = self._find([values], bucket.plan.param_indices)
            self._sparse_bad[bucket.index] = found
            if self.pre_launch:
                self._note(found)

    def _note(self, found: list[tuple[str, int, int, int]]) -> None:
        if found:
            self._offenders += found
            self._count += 1

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

    def after_wait(self, buckets: Sequence[Any], comm_hook: bool, flag_apart: bool | None = None) -> None:
        """End of backward, every rank, after the waits and before the status exchange: raise if any rank was bad.
        ``flag_apart`` (default: ``comm_hook``): the last bucket has no spare element in its collective (a comm
        hook's buffer, a sparse bucket), so the count needs an all-reduce of its own."""
        flag_apart = comm_hook if flag_apart is None else flag_apart
        self.backwards += 1
        try:
            if self.after_reduce(buckets[-1].buffer, comm_hook):
                flags = torch.tensor(
                    [
                        int(b.index in self._sparse_bad) if b.plan.sparse else int(not self._slice_finite(b.flat))
                        for b in buckets
                    ],
                    dtype=torch.int32,
                )
                # collectives.clean
                self.last_work = launch_clean(dist.all_reduce, flags, group=self.group, async_op=True)
                self.last_work.wait()
                if flags.any():
                    self._raise(buckets, [b for b, bad in zip(buckets, flags.tolist()) if bad])
                return
            if flag_apart:
                count = torch.tensor([float(self._count)], dtype=torch.float32)
                if dist.get_backend(self.group) == "nccl":
                    count = count.to(buckets[-1].buffer.device)
                self.last_work = launch_clean(dist.all_reduce, count, group=self.group, async_op=True)
                self.last_work.wait()
                total_bad = round(count.item())
            else:
                spare = buckets[-1].buffer[-1:]
                value = round(spare.item())  # the read the status exchange does anyway
                total_bad = value // int(self.scale)
                if total_bad:
                    spare.sub_(total_bad * self.scale)  # leave the missing-gradient count for the status exchange
            if total_bad:
                self._raise(buckets)
        finally:
            self.reset()

    def _slice_finite(self, flat: torch.Tensor) -> bool:
        """This rank's share of an averaged bucket: elements [n*r/w, n*(r+1)/w)."""
        n = flat.numel()
        lo, hi = n * self.group_rank // self.world_size, n * (self.group_rank + 1) // self.world_size
        if hi == lo:
            return True
        part = flat[lo:hi]
        # A float32 sum of large finite values can overflow: only then look element by element.
        return math.isfinite(_sum(part).item()) or bool(torch.isfinite(part).all())

    def _local(self, buckets: Sequence[Any]) -> list[tuple[str, int, int, int]]:
        """This rank's local gradients in these buckets that hold a NaN or Inf (a flagged step only)."""
        found = []
        for bucket in buckets:
            if bucket.plan.sparse:
                found += self._sparse_bad.get(bucket.index, [])  # read before its all-reduce (``check_sparse``)
                continue
            for i, g, view in zip(bucket.plan.param_indices, bucket.grads, bucket.views):
                if g is None:
                    continue  # this rank contributed zeros
                if g.data_ptr() != view.data_ptr():
                    found += self._find([g.detach()], [i])  # untouched by the all-reduce
                elif not bool(torch.isfinite(view).all()):  # .grad was the bucket's view: averaged in place
                    found.append((self.names[i], -1, -1, view.numel()))
        return found

    def _raise(self, buckets: Sequence[Any], averaged: Sequence[Any] | None = None) -> None:
        """Every rank: name the offenders. ``averaged``: the flagged buckets, checked after the all-reduce."""
        mine = list(self._offenders) if averaged is None else self._local(averaged)
        for index, flag in self._device_flags.items():  # CUDA: find them now (a flagged step only)
            if bool(flag.item()):
                bucket = buckets[index]
                grads = [
                    g if g is not None and g.data_ptr() != v.data_ptr() else None
                    for g, v in zip(bucket.grads, bucket.views)
                ]
                if all(g is not None for g in grads):  # the local gradients, untouched by the all-reduce
                    mine += self._find([g.detach() for g in grads if g is not None], bucket.plan.param_indices)
                else:  # gradient_as_bucket_view: the local values were averaged in place
                    mine.append(
                        (" / ".join(self.names[i] for i in bucket.plan.param_indices[:8]), -1, -1, bucket.flat.numel())
                    )
        gathered: list = [None] * self.world_size
        launch_clean(dist.all_gather_object, gathered, (dist.get_rank(), mine), group=self.group)
        parts = [f"rank {rank}: {self._describe(found)}" for rank, found in gathered if found]
        if parts:
            first_rank = next(rank for rank, found in gathered if found)
            raise self._error(
                f"non-finite gradient on rank {first_rank}, caught before any rank's optimizer could apply it: "
                f"{'; '.join(parts)}. "
                "Every rank raises here, so no optimizer step runs. When every gradient is non-finite, the loss was "
                "(look at that rank's inputs and loss for this step); when a few are, the last of them in the "
                "model's order is where backward first produced one. Pass detect_nonfinite=False to turn the check off."
            )
        if averaged:  # every rank's local gradients were finite: their sum overflowed (the same text on every rank)
            found = [f for b in averaged for f in self._find(b.views, b.plan.param_indices)]
            dtypes = sorted({str(b.flat.dtype).replace("torch.", "") for b in averaged})
            raise self._error(
                "non-finite average of finite gradients: every rank's local gradients were finite, "
                "but the all-reduce's "
                f"sum overflowed ({'/'.join(dtypes)}), caught before any rank's optimizer could apply it: "
                f"{self._describe(found)}. "
                "Every rank raises here, so no optimizer step runs. The gradients are near the largest value of their "
                "dtype: lower the loss scale or the learning rate, clip the loss, or train these parameters in a wider "
                "dtype. Pass detect_nonfinite=False to turn the check off."
            )
        # CUDA: every flagged sum had overflowed on finite local values (not an error there)

    def _error(self, detail: str) -> NonfiniteGradientError:
        """The error, prefixed with when: a bare DDP's loop counts its steps as its synchronised backwards (one
        per step, the last micro-batch of each under no_sync accumulation)."""
        n = self.backwards
        return NonfiniteGradientError(f"at step {n} (synchronised backward {n} of this DDP, counted from 1; "
                                      f"backwards under no_sync are not counted): {detail}", step=n, detail=detail)

    def _describe(self, found: list[tuple[str, int, int, int]]) -> str:
        order = {name: i for i, name in enumerate(self.names)}
        found = sorted(found, key=lambda f: order.get(f[0], -1))  # registration order: forward's order
        shown = [
            f"{name!r} ({'?' if nans < 0 else f'{nans} NaN, {infs} Inf of {numel}'})"
            for name, nans, infs, numel in found[:4]
        ]
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        return f"{len(found)} of {len(self.names)} parameters, {', '.join(shown)}{more}"


def _sum(flat: torch.Tensor) -> torch.Tensor:
    """One pass; fp16/bf16 summed in float32, where a sum of finite values cannot overflow."""
    return flat.sum(dtype=torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None)
