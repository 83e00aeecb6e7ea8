"""DistributedDataParallel's typed configuration: the bucket caps, and the options only lockstep has.

Each is one frozen dataclass, validated in ``__post_init__`` (the one place: a bad value fails at construction
with a message naming the argument), with a docstring per field. The wrapper builds them from its
torch-compatible arguments; the reducer takes ``BucketCaps`` whole.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.ddp.autotune import AutoBucketCap
from lockstep.ddp.buckets import DEFAULT_FIRST_BUCKET_BYTES, MIB, first_bucket_caps

DEFAULT_BUCKET_CAP_MB = 25.0
# Where one all-reduce's fixed cost (~0.5 ms at 2 ranks on gloo) is below what the copies in and out
# of a bucket cost a gradient this large (~0.15 ms per MB each way, measured on the 10.5M MLP).
DEFAULT_DIRECT_MIN_BYTES = 4 * MIB


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class BucketCaps:
    """How large the reducer's buckets may grow (``buckets.assign_buckets`` has the rules)."""

    cap_mb: float = DEFAULT_BUCKET_CAP_MB
    """``bucket_cap_mb``: the cap of every bucket after the first, in MiB (> 0); with ``auto``, the first steps'."""
    cap_mb_list: tuple[float, ...] | None = None
    """``bucket_cap_mb_list``: each bucket's cap in turn, in MiB (the last repeats); replaces ``cap_mb`` and
    ``first_bytes``."""
    auto: AutoBucketCap | None = None
    """``bucket_cap_mb="auto"``: caps tried over the first steps, the fastest kept (``autotune``); None: fixed caps."""
    first_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
    """The first bucket's cap in the first iteration (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``), the same on every
    rank."""
    rebuilt_first_bytes: int | None = None
    """This rank's first-bucket cap for the layout rebuilt after the first iteration; rank 0's is used on every
    rank (``layout.agree_on_order``). None: ``first_bytes``."""
    direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES
    """A CPU parameter at least this large (copies mode) is all-reduced in its own gradient, no copy in or out
    (``copy_in``); None: never."""
    link_aware: bool = False
    """The caller left ``bucket_cap_mb`` and ``bucket_cap_mb_list`` unset: where the first backward's gradients
    crossed slowly (``autotune.tail_wants_trials``), the caps go to ``"auto"``'s trials after it."""

    def __post_init__(self) -> None:
        if isinstance(self.cap_mb, str):  # a ValueError, as it always was (scripts catch it)
            raise ValueError(
                f"DistributedDataParallel: bucket_cap_mb must be a number > 0 or 'auto', got {self.cap_mb!r}")
        if not self.cap_mb > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be > 0, got {self.cap_mb}")
        if self.cap_mb_list is not None:
            caps = list(self.cap_mb_list)
            if not caps or any(not (c > 0) for c in caps):
                raise ValueError(
                    f"DistributedDataParallel: bucket_cap_mb_list must be non-empty and all > 0, got {caps}"
                )
            object.__setattr__(self, "cap_mb_list", tuple(caps))
            if self.auto is not None:
                raise ValueError(
                    "DistributedDataParallel: bucket_cap_mb='auto' and bucket_cap_mb_list exclude each other"
                )
        if self.auto is not None and not isinstance(self.auto, AutoBucketCap):
            raise TypeError(f"BucketCaps.auto must be an AutoBucketCap or None, got {self.auto!r}")
        for name in ("first_bytes", "rebuilt_first_bytes", "direct_min_bytes"):
            value = getattr(self, name)
            if not (_positive_int(value) or (value is None and name != "first_bytes")):
                raise ValueError(
                    f"BucketCaps.{name} must be an int > 0{'' if name == 'first_bytes' else ' or None'}, got {value!r}"
                )
        if self.rebuilt_first_bytes is None:
            object.__setattr__(self, "rebuilt_first_bytes", self.first_bytes)

    @classmethod
    def from_ddp_args(cls, bucket_cap_mb: Any, bucket_cap_mb_list: Sequence[float] | None) -> BucketCaps:
        """From DDP's ``bucket_cap_mb`` (a number, None, ``"auto"`` or an ``AutoBucketCap``) and
        ``bucket_cap_mb_list``."""
        auto = None
        if bucket_cap_mb == "auto":
            auto, bucket_cap_mb = AutoBucketCap(), None
        elif isinstance(bucket_cap_mb, AutoBucketCap):
            auto, bucket_cap_mb = bucket_cap_mb, None  # the first step runs with the default cap
        link_aware = bucket_cap_mb is None and bucket_cap_mb_list is None and auto is None
        return cls(DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
                   None if bucket_cap_mb_list is None else tuple(bucket_cap_mb_list), auto, link_aware=link_aware)

    def for_machine(self, device_type: str, world_size: int, small_first_bucket: bool | None,
                    direct_min_bytes: int | None) -> BucketCaps:
        """These caps with the first bucket's (``buckets.first_bucket_caps``: torch's small one in the first iteration,
        and this rank's wish for the rebuilt layout) and the direct threshold (DDP's class attributes) filled in."""
        first, rebuilt_first = first_bucket_caps(device_type, world_size, self.cap_bytes, small_first_bucket)
        return dataclasses.replace(
            self, first_bytes=first, rebuilt_first_bytes=rebuilt_first, direct_min_bytes=direct_min_bytes
        )

    @property
    def bucket_bytes_cap(self) -> int:
        """``cap_mb`` in bytes as torch's DDP states it (its attribute ``bucket_bytes_cap``, which dynamo reads)."""
        return int(self.cap_mb * MIB)

    @property
    def cap_bytes(self) -> int:
        return max(1, self.bucket_bytes_cap)

    @property
    def caps_bytes(self) -> list[int] | None:
        """``cap_mb_list`` in bytes (``assign_buckets``' ``bucket_caps_bytes``), or None."""
        return None if self.cap_mb_list is None else [max(1, int(c * MIB)) for c in self.cap_mb_list]


@dataclass(frozen=True)
class DiagnosticsOptions:
    """DDP's options that torch's DDP has not (docs/debugging.md); all off by default but the hang watchdog."""

    check_replicas_every: int | None = None
    """Every N synchronised steps, check at the next forward that every rank holds the same parameters; None: never."""
    detect_nonfinite: bool = False
    """Check the gradients for NaN/Inf before they are averaged; every rank raises naming the rank and parameter."""
    trace_dir: str | os.PathLike | None = None
    """Record the overlap timeline of steps ``trace_steps`` there (rank 0 writes it); None: $LOCKSTEP_TRACE or off."""
    trace_steps: tuple[int, int] | None = None
    """The synchronised steps (first, last) the trace records; None: $LOCKSTEP_TRACE_STEPS, else 5..10."""

    def __post_init__(self) -> None:
        every = self.check_replicas_every
        if every is not None and not _positive_int(every):
            raise ValueError(
                f"DistributedDataParallel: check_replicas_every must be an int >= 1 or None, got {every!r}"
            )
        object.__setattr__(self, "detect_nonfinite", bool(self.detect_nonfinite))
