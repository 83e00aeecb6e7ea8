"""Hooks and stages: ``allreduce_hook``, fp16/bf16 compression, error feedback, and ``chain``.

A stage is a function from a hook to a hook; see the package docstring for how
they compose.
"""

from typing import Any

import torch
import torch.distributed as dist

from lockstep.comm_hooks.base import (
    BucketLike,
    Future,
    Hook,
    Stage,
    average_async,
    averages_in,
    collectives_up_front,
    completed,
    gradient_offsets,
    group_of,
    issues_collectives_up_front,
    tensor_of,
)

# No `from __future__ import annotations` here: torch's DDP compares a hook's annotations with
# dist.GradBucket and Future[torch.Tensor] by value (DistributedDataParallel._check_comm_hook), and a
# postponed annotation is a string that fails the check.


# ----------------------------------------------------------------- allreduce
_ALGORITHMS = ("native", "ring", "tree")


def _allreduce_with(algorithm: str) -> Hook:
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"allreduce_hook: algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    if algorithm == "native":
        return allreduce_hook

    def hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        # Imported on use: the native path must not need lockstep.collectives.
        from lockstep.collectives import all_reduce

        group = group_of(state)
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size(group))
        all_reduce(tensor, algorithm=algorithm, group=group)  # in-place SUM, returns when done
        return completed(tensor)

    hook.__name__ = hook.__qualname__ = f"allreduce_hook_{algorithm}"
    return hook


@collectives_up_front
def allreduce_hook(
    state: Any = None,
    # Exactly dist.GradBucket, not Optional: torch's register_comm_hook compares the annotation by value.
    bucket: dist.GradBucket = None,  # type: ignore[assignment]
    *,
    algorithm: str | None = None,
):
    """Average the bucket over the group: what DDP does without a hook, as a hook.

    Two uses: as a hook, ``register_comm_hook(group, allreduce_hook)``; or as a
    factory, ``allreduce_hook(algorithm="ring" | "tree" | "native")`` returns a
    hook that sums with ``lockstep.collectives.all_reduce`` (ring and tree are
    synchronous, so the hook blocks until its bucket is reduced: no overlap
    with the rest of backward, which the native path keeps). Divides before
    summing, as torch's reducer does (see ``average_async``), so with no
    other change it reproduces DDP without a hook bit for bit.
    """
    if bucket is None:
        if state is not None:
            raise TypeError("allreduce_hook(state, bucket): got a state but no bucket")
        return _allreduce_with("native" if algorithm is None else algorithm)
    if algorithm is not None:
        raise TypeError("allreduce_hook: pass algorithm alone to build a hook, not with a bucket")
    return average_async(bucket.buffer(), group_of(state))


# ----------------------------------------------------------------- stages and chain
def stage(wrap: Stage) -> Stage:
    """Mark ``wrap`` (a function from the inner hook to a hook) as a stage that ``chain`` accepts."""
    wrap._lockstep_stage = True  # type: ignore[attr-defined]
    return wrap


def is_stage(obj: Any) -> bool:
    return bool(getattr(obj, "_lockstep_stage", False))


def chain(*parts: Any) -> Hook:
    """Compose stages around a hook: ``chain(s1, s2, hook)`` is ``s1(s2(hook))``.

    Every part but the last must be a stage (see ``stage``); the last must be a
    hook. ``chain(hook)`` is ``hook``.
    """
    if not parts:
        raise TypeError("chain() needs at least a hook, e.g. chain(bf16_compress, allreduce_hook)")
    *stages, hook = parts
    if is_stage(hook) or not callable(hook):
        raise TypeError(f"chain: the last part must be a hook (state, bucket) -> Future, got {_name(hook)}")
    for i, part in enumerate(stages):
        if isinstance(part, type):
            raise TypeError(f"chain: part {i} is the class {part.__name__}; pass an instance, {part.__name__}()")
        if not is_stage(part):
            raise TypeError(
                f"chain: part {i} ({_name(part)}) is not a stage; only the last part may be a hook. "
                "Mark your own wrapper with @lockstep.comm_hooks.stage"
            )
    for part in reversed(stages):
        hook = part(hook)
    return hook


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


class CompressedBucket:
    """The bucket an inner hook sees under a compression stage: same layout, the compressed buffer.

    ``gradients()`` are views into the compressed buffer, shaped like the
    parameters, so hooks that work per tensor (PowerSGD) run unchanged inside.
    """

    def __init__(self, outer: BucketLike, compressed: torch.Tensor):
        self._outer = outer
        self._buffer = compressed
        self._views: list[torch.Tensor] | None = None

    def index(self) -> int:
        return self._outer.index()

    def is_last(self) -> bool:
        return self._outer.is_last()

    def parameters(self) -> list[torch.Tensor]:
        return self._outer.parameters()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer, as torch's GradBucket does (a hook may swap in another dtype)."""
        if tensor.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer: bucket {self.index()} holds {self._buffer.numel()} elements, got {tensor.numel()}"
            )
        self._buffer, self._views = tensor.view(-1), None

    def gradients(self) -> list[torch.Tensor]:
        # The outer bucket's layout, laid over the compressed buffer (computed once: hooks may ask often).
        if self._views is None:
            offsets = gradient_offsets(self._outer)
            # As strided as the outer views (a channels_last weight's slot is channels_last in the buffer).
            self._views = [
                self._buffer.as_strided(g.shape, g.stride(), self._buffer.storage_offset() + o)
                for o, g in zip(offsets, self._outer.gradients())
            ]
        return list(self._views)


def _compress_stage(dtype: torch.dtype) -> Stage:
    def wrap(inner: Hook) -> Hook:
        def hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
            buffer = bucket.buffer()
            compressed = buffer.to(dtype)  # one copy at half the bytes; a no-op if already `dtype`
            fut = inner(state, CompressedBucket(bucket, compressed))

            def decompress(fut: Future) -> torch.Tensor:
                buffer.copy_(tensor_of(fut.value()).view(-1))  # in place: no second full-size buffer
                return buffer

            return fut.then(decompress)

        hook.__name__ = hook.__qualname__ = f"{dtype_name}_compress({_name(inner)})"
        # Its callback only casts back: it issues collectives up front exactly when the inner hook does.
        return collectives_up_front(hook) if issues_collectives_up_front(inner) else hook

    dtype_name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    wrap.__name__ = wrap.__qualname__ = f"{dtype_name}_compress"
    return stage(wrap)


fp16_compress: Stage = _compress_stage(torch.float16)
fp16_compress.__doc__ = "Stage: the inner hook reduces an fp16 copy of the bucket (half the bytes on the wire)."
bf16_compress: Stage = _compress_stage(torch.bfloat16)
bf16_compress.__doc__ = "Stage: the inner hook reduces a bf16 copy (fp32's range, 8 bits of mantissa)."

# The composed hooks keep the names chain gives them ("bf16_compress(allreduce_hook)"): torch's DDP
# refuses a hook *named* bf16_compress_hook without NCCL, though gloo sums bf16 on CPU.
#: Average an fp16 copy of the bucket: bitwise torch's ``default_hooks.fp16_compress_hook``.
#: lockstep's DDP runs it without calling it (``lockstep.ddp.fused_compress``), with the same result.
fp16_compress_hook: Hook = averages_in(torch.float16, chain(fp16_compress, allreduce_hook))
#: Average a bf16 copy of the bucket: bitwise torch's ``default_hooks.bf16_compress_hook``.
bf16_compress_hook: Hook = averages_in(torch.bfloat16, chain(bf16_compress, allreduce_hook))


class ErrorFeedback:
    """Stage: add back what the inner hook lost last step (error feedback: Seide et al. 2014, Karimireddy et al. 2019).

    Each rank keeps ``e = (g + e_prev) - reduced`` for every parameter. The
    ranks' ``e`` average to the error of the last reduced average, so the next
    average pays it back and the compression's bias does not accumulate. Costs
    one gradient-sized tensor per bucket (in the buffer's dtype), a clone and a
    subtraction per step. Memory is keyed by parameter, so it survives DDP
    rebuilding its buckets (once, after the first iteration) and gives the same
    result whatever the bucket layout. One instance per model.
    """

    _lockstep_stage = True

    def __init__(self) -> None:
        self.errors: dict[int, torch.Tensor] = {}

    def __call__(self, inner: Hook) -> Hook:
        def hook(state: Any, bucket: dist.GradBucket) -> Future[torch.Tensor]:
            buffer = bucket.buffer()
            keys = [p.data_ptr() for p in bucket.parameters()]  # a parameter's storage: stable for the run
            grads, offsets = bucket.gradients(), gradient_offsets(bucket)
            for key, grad in zip(keys, grads):
                error = self.errors.get(key)
                if error is not None and error.shape == grad.shape and error.dtype == grad.dtype:
                    grad.add_(error)  # a view into the buffer
            wanted = buffer.clone()  # the inner hook overwrites the buffer in place

            def remember(fut: Future) -> torch.Tensor:
                reduced = tensor_of(fut.value()).view(-1)
                error = wanted.sub_(reduced)
                for key, grad, offset in zip(keys, grads, offsets):
                    self.errors[key] = error[offset : offset + grad.numel()].view(grad.shape)
                return reduced

            return inner(state, bucket).then(remember)

        hook.__name__ = hook.__qualname__ = f"ErrorFeedback({_name(inner)})"
        return collectives_up_front(hook) if issues_collectives_up_front(inner) else hook  # as the compress stages
