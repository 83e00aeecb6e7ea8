"""The bucket object a communication hook receives: torch's ``dist.GradBucket`` contract, in Python.

Hooks written for torch's DDP call ``bucket.buffer()``, ``index()``, ``is_last()``,
``parameters()``, ``gradients()`` and sometimes ``set_buffer()``; this class offers
exactly those over a reducer bucket, so such hooks run unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.ddp.reducer_state import slot_view


class GradBucket:
    """A view of one reducer bucket for a comm hook. The buffer holds the local (not yet divided) gradients."""

    __slots__ = ("_bucket", "_num_buckets", "_buffer")

    def __init__(self, bucket: Any, num_buckets: int):
        self._bucket = bucket
        self._num_buckets = num_buckets
        # A direct or sparse bucket's buffer is the gradient itself (``copy_in``)
        self._buffer = bucket.sparse if bucket.plan.sparse else bucket.flat if bucket.direct is None else bucket.direct

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer of the bucket's gradients (or what ``set_buffer`` put there); may be reduced in place.
        A sparse bucket's is its one sparse gradient, as torch's."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace what ``buffer()`` returns, as torch's does (its fp16/bf16 compress wrappers rely on it).

        The reducer takes the hook's result from the returned future, never from this tensor, so a
        replaced buffer of another dtype is fine; the parameters' views keep pointing at the bucket.
        """
        numel = self._bucket.params[0].numel() if self._bucket.plan.sparse else self._bucket.flat.numel()
        if tensor.numel() != numel:
            raise ValueError(f"set_buffer: bucket {self.index()} holds {numel} elements, got {tensor.numel()}")
        self._buffer = tensor if tensor.is_sparse else tensor.reshape(-1)

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in this backward."""
        return self._bucket.index == self._num_buckets - 1

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into ``buffer()`` (shaped like the parameter), as torch's."""
        if self._buffer is self._bucket.flat:
            return list(self._bucket.views)
        if self._bucket.plan.sparse:
            return [self._buffer]
        return [slot_view(self._buffer, offset, p) for offset, p in zip(self._bucket.plan.offsets, self._bucket.params)]

    def __repr__(self) -> str:
        return f"GradBucket(index={self.index()}, numel={self._bucket.flat.numel()}, params={len(self._bucket.params)})"
