"""The bucket object a communication hook receives: torch's ``dist.GradBucket`` contract, in Python.

Hooks written for torch's DDP call ``bucket.buffer()``, ``index()``, ``is_last()``,
``parameters()``, ``gradients()`` and sometimes ``set_buffer()``; this class offers
exactly those over a reducer bucket, so such hooks run unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


class GradBucket:
    """A view of one reducer bucket for a comm hook. The buffer holds the local (not yet divided) gradients."""

    __slots__ = ("_bucket", "_num_buckets")

    def __init__(self, bucket: Any, num_buckets: int):
        self._bucket = bucket
        self._num_buckets = num_buckets

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer of the bucket's gradients; a hook may reduce it in place."""
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents (copied: the parameters' views keep pointing at the bucket)."""
        if tensor.numel() != self._bucket.buffer.numel():
            raise ValueError(
                f"set_buffer: bucket {self.index()} holds {self._bucket.buffer.numel()} elements, got {tensor.numel()}"
            )
        self._bucket.buffer.copy_(tensor.reshape(-1))

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in this backward."""
        return self._bucket.index == self._num_buckets - 1

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view into the buffer (shaped like the parameter)."""
        return list(self._bucket.views)

    def __repr__(self) -> str:
        return f"GradBucket(index={self.index()}, numel={self._bucket.buffer.numel()}, params={len(self._bucket.params)})"
