"""The contract every communication hook works to, and the helpers hooks share.

A hook is ``hook(state, bucket) -> Future``: ``bucket`` offers torch's
``dist.GradBucket`` surface (``BucketLike``), ``state`` names the process group
(``group_of``). This module is the only thing the reducer and the hooks both
know of each other: hooks import nothing from ``lockstep.ddp``.
"""

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: torch's DDP compares a hook's annotations with
# dist.GradBucket and Future[torch.Tensor] by value (DistributedDataParallel._check_comm_hook), and a
# postponed annotation is a string that fails the check.

Future = torch.futures.Future
Hook = Callable[[Any, Any], Future]
Stage = Callable[[Hook], Hook]


class BucketLike(Protocol):
    """What a hook may ask of a bucket: torch's ``dist.GradBucket`` surface."""

    def index(self) -> int: ...
    def buffer(self) -> torch.Tensor: ...
    def is_last(self) -> bool: ...
    def parameters(self) -> list[torch.Tensor]: ...
    def gradients(self) -> list[torch.Tensor]: ...


# ----------------------------------------------------------------- helpers
def group_of(state: Any) -> dist.ProcessGroup | None:
    """The process group a hook's ``state`` names (``None`` means the default group)."""
    if state is None or isinstance(state, dist.ProcessGroup):
        return state
    if hasattr(state, "process_group"):
        return state.process_group
    raise TypeError(
        f"comm hook state must be a ProcessGroup, None (the default group) or an object with a "
        f"'process_group' attribute, got {type(state).__name__}"
    )


def completed(tensor: torch.Tensor) -> Future:
    """A Future already holding ``tensor``: how a synchronous reduction honours the hook contract."""
    fut: Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def tensor_of(value: Any) -> torch.Tensor:
    """A hook's Future value is a tensor or, as torch's own hooks return, a list whose first item is one."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise TypeError(f"a comm hook's Future must hold a tensor or a list of tensors, got {type(value).__name__}")


def gradient_offsets(bucket: Any) -> list[int]:
    """Where each of ``bucket.gradients()`` starts in ``bucket.buffer()``, in elements.

    Read from the views themselves rather than assumed contiguous: a reducer
    may pad or append to its buffer, and a hook must not misplace a gradient.
    """
    buffer = bucket.buffer()
    offsets = []
    for i, grad in enumerate(bucket.gradients()):
        offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        if grad.dtype != buffer.dtype or not 0 <= offset <= buffer.numel() - grad.numel():
            raise RuntimeError(f"bucket {bucket.index()}: gradient {i} is not a view into the bucket's buffer")
        offsets.append(offset)
    return offsets


def average_async(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Future:
    """Average ``tensor`` in place over ``group`` with the backend's own all-reduce; Future of ``tensor``.

    Divides *before* summing, as torch's reducer does: the sum of world_size
    low-precision values can overflow where their average would not, and the
    result is bitwise what DDP computes without a hook, for every world size.
    """
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: tensor_of(fut.value()))
