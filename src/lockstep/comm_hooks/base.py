"""The contract every communication hook works to, and the helpers hooks share.

A hook is ``hook(state, bucket) -> Future``: ``bucket`` offers torch's
``dist.GradBucket`` surface (``BucketLike``), ``state`` names the process group
(``group_of``). This module is the only thing the reducer and the hooks both
know of each other: hooks import nothing from ``lockstep.ddp``.
"""

import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: torch's DDP compares a hook's annotations with
# dist.GradBucket and Future[torch.Tensor] by value (DistributedDataParallel._check_comm_hook), and a
# postponed annotation is a string that fails the check.

Future = torch.futures.Future
Hook = Callable[[Any, Any], Future]
Stage = Callable[[Hook], Hook]
_H = TypeVar("_H", bound=Callable[..., Any])  # a hook, or a factory of hooks like allreduce_hook


class BucketLike(Protocol):
    """What a hook may ask of a bucket: torch's ``dist.GradBucket`` surface."""

    def index(self) -> int: ...
    def buffer(self) -> torch.Tensor: ...
    def is_last(self) -> bool: ...
    def parameters(self) -> list[torch.Tensor]: ...
    def gradients(self) -> list[torch.Tensor]: ...


def contract_error(hook: Any) -> Exception | None:
    """Why ``register_comm_hook`` must refuse ``hook``, or None: torch's checks (callable; a ``bucket`` annotation
    that is ``dist.GradBucket``; a return annotation that is ``Future[torch.Tensor]``), with the hook's name.

    Differs from torch's on purpose in two ways that only accept more: a postponed (string) annotation naming
    GradBucket / Future passes (torch's check compares by value, so under ``from __future__ import annotations``
    it refuses a correctly annotated hook), and the bucket may be the second parameter under another name (torch's
    check raises a bare ``KeyError: 'bucket'`` there). An unannotated hook passes, as in torch.
    """
    if not callable(hook):
        return TypeError(f"Communication hook must be callable, got {type(hook).__name__}")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    name = getattr(hook, "__qualname__", type(hook).__name__)
    params = list(signature.parameters.values())
    bucket = signature.parameters.get("bucket") or (params[1] if len(params) > 1 else None)
    if bucket is not None and not _names(
        bucket.annotation, "GradBucket", lambda a: isinstance(a, type) and "GradBucket" in a.__name__
    ):
        return ValueError(f"Communication hook: bucket annotation should be dist.GradBucket; {name}'s "
                          f"{bucket.name!r} is annotated {bucket.annotation!r}")
    returned = signature.return_annotation
    if not _names(returned, "Future", lambda a: a == Future[torch.Tensor] or a is Future):
        return ValueError(f"Communication hook: return annotation should be torch.futures.Future[torch.Tensor]; "
                          f"{name} returns {returned!r}")
    return None


def _names(annotation: Any, word: str, matches: Callable[[Any], bool]) -> bool:
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):
        return word in annotation
    return matches(annotation)


# ----------------------------------------------------------------- issuing order
_UP_FRONT = "_lockstep_collectives_up_front"


def collectives_up_front(hook: _H) -> _H:
    """Declare that ``hook`` issues every collective from the call itself, none from a Future callback.

    Such a hook issues its collectives in bucket order on every rank (buckets are handed to hooks
    in index order), so DDP may keep several of its buckets in flight at once and overlap them
    with the rest of backward. A hook that issues collectives from callbacks (torch's PowerSGD:
    its Q all-reduce is issued when P's completes, on the backend's thread) must not be declared:
    its collectives could interleave with the next bucket's in a different order on each rank.
    Returns ``hook`` (usable as a decorator).
    """
    setattr(hook, _UP_FRONT, True)
    return hook


def _torch_up_front_hooks() -> tuple:
    # torch's default hooks issue their one all-reduce in the call (only a cast-back copy runs in
    # the callback): recognised by identity, as they cannot be marked. Imported on use.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)


def issues_collectives_up_front(hook: Any) -> bool:
    """True for a hook declared with ``collectives_up_front`` or one of torch's default hooks.

    Unknown hooks give False: DDP then keeps one of their buckets in flight at a time (safe for any hook).
    """
    if getattr(hook, _UP_FRONT, False):
        return True
    try:
        return hook in _torch_up_front_hooks()
    except ImportError:  # pragma: no cover - a torch without ddp_comm_hooks
        return False


# ----------------------------------------------------------------- compressed averages
_AVERAGES_IN = "_lockstep_averages_in"


def averages_in(dtype: torch.dtype, hook: _H) -> _H:
    """Declare that ``hook`` averages a ``dtype`` copy of the bucket over ``group_of(state)`` and nothing else:
    cast, divide by the group's size, sum, cast back (torch's fp16/bf16 compress hooks, bit for bit).

    DDP may then run that average itself instead of calling the hook (``lockstep.ddp.fused_compress``),
    with the same result. Returns ``hook``.
    """
    setattr(hook, _AVERAGES_IN, dtype)
    return hook


def compressed_average_dtype(hook: Any) -> torch.dtype | None:
    """The dtype in which ``hook`` averages a copy of its bucket (``averages_in``; torch's compress hooks), or None."""
    dtype = getattr(hook, _AVERAGES_IN, None)
    if dtype is not None:
        return dtype
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError:  # pragma: no cover - a torch without ddp_comm_hooks
        return None
    if hook is default_hooks.fp16_compress_hook:
        return torch.float16
    if hook is default_hooks.bf16_compress_hook:
        return torch.bfloat16
    return None


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
