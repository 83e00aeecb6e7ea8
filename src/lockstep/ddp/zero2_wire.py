"""Which collectives carry ZeRO-2's buckets: a reduce-scatter and all-gather pair, one object per way.

``choose_collectives`` picks one of three; ``ZeroShards`` calls its ``reduce_scatter`` for each bucket in backward and
its ``all_gather`` for each after the shard's step, and waits for the works they return (``wait``, ``is_completed``).

* ``FlatPair``: ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, the default on NCCL and other backends.
* ``AllReducePair``: the reduce-scatter as an all-reduce of the bucket in place with this rank's slice kept, the
  all-gather an all-reduce of the flat parameters in place with every slice but this rank's set to -0.0 (x + -0.0 is
  x, bit for bit, -0.0 and NaN included): twice a DDP step's bytes on the wire, no extra memory.
* ``RingPair``: the ring's two halves over send/recv (``collectives.ring``), queued to a thread of their own on a
  group made at binding (``collectives.ring_queue``): each rank sends (N-1)/N of a bucket in each half, what a DDP
  step's ring all-reduce sends, and rank r's chunk is its shard, so the reduce's last add lands in the shard's
  gradient with no copy. The default on gloo with CPU tensors.

On gloo (torch 2.13, CPU) the flat pair costs 1.5-7 x an all-reduce of the same buffer and allocates 0.6-2 x its size
besides (a 33 MB bucket on loopback: reduce-scatter 57-331 ms and +20-51 MB, all-gather 69-331 ms and +32-64 MB,
all-reduce 40-141 ms and +2 MB; a 200 MB buffer: 881-1321 ms against 166-204). The all-reduce pair avoids that at
twice the bytes; the ring pair sends half as many and measured no slower on loopback at 2 ranks (ZeRO-2's step
0.94-1.01 x the all-reduce pair's, 0.81-0.98 x with the all-gathers under the next forward: benchmarks/ddp_step.py,
docs/ddp.md#zero-2-sharded-gradients-and-optimizer-state), so it is gloo's default; its cost is a group and a thread
per binding, and the thread's Python between messages. gloo with CUDA tensors (no send/recv there) and a backend
without the flat pair (an older torch's gloo) take the all-reduce pair. ``LOCKSTEP_ZERO_COLLECTIVES=
flat|all_reduce|ring`` chooses; ``opt.collectives`` says which ran.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.collectives.clean import launch_clean
from lockstep.collectives.ring_queue import RingQueue

# torch >= 2.12 names them *_single (the *_tensor names warn, FutureWarning); older torch has the *_tensor ones.
_REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_ALL_GATHER: Any = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
COLLECTIVES_ENV = "LOCKSTEP_ZERO_COLLECTIVES"  # flat, all_reduce or ring; unset: ring on gloo (CPU), else flat
CHOICES = ("flat", "all_reduce", "ring")


class ShardCollectives(Protocol):
    """One way to reduce-scatter a padded bucket and all-gather a padded flat parameter buffer over ``group``."""

    name: str  # the LOCKSTEP_ZERO_COLLECTIVES value that chooses it
    kinds: tuple[str, str]  # what ``opt.collectives`` says: the reduce's and the gather's

    def reduce_scatter(self, source: torch.Tensor, out: torch.Tensor, label: str) -> tuple[Any, torch.Tensor | None]:
        """Start the sum of ``source`` (padded: N equal slices), slice ``rank`` into ``out``. Returns the work and,
        where the work leaves the whole sum in ``source`` instead, ``source`` (the waiter copies the slice out)."""
        ...

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, label: str) -> Any:
        """Start filling ``flat`` with every rank's slice; ``shard`` is this rank's (a view of ``flat``)."""
        ...

    def gather_state(self, full: torch.Tensor, value: torch.Tensor) -> None:
        """Every rank's ``value`` (a shard's optimizer state) into ``full``, now (a checkpoint's, not a step's)."""
        ...


def gather_chunks(full: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's ``value`` into its chunk of ``full``, now, with torch's list all-gather (any backend)."""
    dist.all_gather(list(full.chunk(dist.get_world_size(group))), value.contiguous(), group=group)


class FlatPair:
    name = "flat"
    kinds = ("reduce_scatter_tensor", "all_gather_into_tensor")

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def reduce_scatter(self, source: torch.Tensor, out: torch.Tensor, label: str) -> tuple[Any, torch.Tensor | None]:
        return launch_clean(_REDUCE_SCATTER, out, source, group=self.group, async_op=True), None

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, label: str) -> Any:
        return launch_clean(_ALL_GATHER, flat, shard.detach(), group=self.group, async_op=True)

    def gather_state(self, full: torch.Tensor, value: torch.Tensor) -> None:
        _ALL_GATHER(full, value.contiguous(), group=self.group)


class AllReducePair:
    name = "all_reduce"
    kinds = ("all_reduce, slice kept", "all_reduce, -0.0 elsewhere")

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.rank = group, dist.get_rank(group)

    def reduce_scatter(self, source: torch.Tensor, out: torch.Tensor, label: str) -> tuple[Any, torch.Tensor | None]:
        return launch_clean(dist.all_reduce, source, group=self.group, async_op=True), source

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, label: str) -> Any:
        size = shard.numel()  # every other rank's slice -0.0, the identity of +: the sum is each slice's owner's
        flat[: self.rank * size].fill_(-0.0)
        flat[(self.rank + 1) * size:].fill_(-0.0)
        return launch_clean(dist.all_reduce, flat, group=self.group, async_op=True)

    def gather_state(self, full: torch.Tensor, value: torch.Tensor) -> None:
        gather_chunks(full, value, self.group)


class RingPair:
    name = "ring"
    kinds = ("ring reduce-scatter (send/recv)", "ring all-gather (send/recv)")

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.queue = RingQueue(group)  # a group and a thread of its own: made here, at binding, on every rank

    def reduce_scatter(self, source: torch.Tensor, out: torch.Tensor, label: str) -> tuple[Any, torch.Tensor | None]:
        return self.queue.reduce_scatter(source, out=out, label=label), None  # source is left as scratch

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor, label: str) -> Any:
        return self.queue.all_gather(flat, label=label)

    def gather_state(self, full: torch.Tensor, value: torch.Tensor) -> None:
        gather_chunks(full, value, self.group)  # a checkpoint's few tensors, on the caller's thread and group

    @property
    def sent_nbytes(self) -> int:
        """Bytes this rank has sent on the ring so far: (N-1)/N of each bucket in each half."""
        return self.queue.sent_nbytes


def choose_collectives(group: dist.ProcessGroup, device: torch.device) -> ShardCollectives:
    """``LOCKSTEP_ZERO_COLLECTIVES``'s pair, else on gloo the ring pair (the all-reduce pair with CUDA tensors) and
    the flat one elsewhere (the module docstring says why). Where the flat pair is wanted, one tiny collective of each
    at binding: a backend without them raises at the call, on every rank alike, before any exchange, and the
    all-reduce pair is taken."""
    wanted = os.environ.get(COLLECTIVES_ENV, "")
    if wanted not in ("", *CHOICES):
        raise ValueError(f"{COLLECTIVES_ENV}={wanted!r}: choose {', '.join(CHOICES[:-1])} or {CHOICES[-1]}")
    gloo = dist.get_backend(group) == "gloo"
    if wanted == "ring" or (not wanted and gloo and device.type == "cpu"):
        return RingPair(group)
    if wanted == "all_reduce" or (not wanted and gloo):
        return AllReducePair(group)
    if _REDUCE_SCATTER is None or _ALL_GATHER is None:
        return AllReducePair(group)
    world_size = dist.get_world_size(group)
    try:
        out = torch.zeros(1, device=device)
        _REDUCE_SCATTER(out, torch.zeros(world_size, device=device), group=group)
        _ALL_GATHER(torch.zeros(world_size, device=device), out, group=group)
    except (RuntimeError, NotImplementedError):
        return AllReducePair(group)
    return FlatPair(group)
