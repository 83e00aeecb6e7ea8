"""One synchronised backward: the plan decided at its start, and the state it fills in as gradients land.

Which path a backward takes (a comm hook called or fused, the missing-gradient flag in the last bucket or
apart, one hooked bucket in flight or all, each bucket copied back right after its wait or all at the end,
the hook's common path or not) cannot change while it runs: the comm hook, the non-finite check, the grad
mode, the divisor and the layout are all set between steps. So ``plan_backward`` decides it once, at the
backward's start, into a frozen ``StepPlan`` that the per-parameter hook, the launches and the end of backward
read; and everything a backward fills in (bucket countdowns, the launch order, what ``copy_back`` must still
do) is one ``Backward``, made whole at the start and dropped whole at the end, never reset field by field.
What only the backward's end can know (``nothing_to_reduce``, ``copy_back_path``) is read from it, as functions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lockstep.comm_hooks.base import issues_collectives_up_front
from lockstep.ddp.fused_compress import FusedCompression
from lockstep.ddp.reducer_state import Bucket
from lockstep.diagnostics.nonfinite import NonfiniteCheck

FLOAT32_SCALED = (torch.float32, torch.float16, torch.bfloat16)

# How a gradient enters its bucket and how the average comes back (``copy_in`` has the three).
COPY, ALIAS, VIEW = "copy", "alias", "view"

# (bucket, slot, view, scale) per parameter index, or None where the hook must take the slow path.
FastEntry = tuple[Bucket, int, torch.Tensor, Any]
# ((layout version, divisor, no comm hook), the table): a reducer's cached common-path table (``cached_fast_table``).
FastCache = tuple[tuple[int, int, bool], list[FastEntry | None]]


def grad_mode(gradient_as_bucket_view: bool | None) -> str:
    """DDP's ``gradient_as_bucket_view`` as a mode: False COPY (torch's default), None ALIAS (lockstep's), True VIEW."""
    if gradient_as_bucket_view is None:
        return ALIAS
    return VIEW if gradient_as_bucket_view else COPY


@functools.lru_cache(maxsize=16)
def reciprocal_f32(divisor: int) -> torch.Tensor:
    """1/divisor as a 0-dim float32 tensor, made once per divisor (it is only ever read).

    A Python float costs torch a scalar-to-tensor wrap per call (~3 us, half of a small gradient's
    copy-in); this tensor takes the same kernel path with the same float32 value (torch's double
    1/divisor, rounded as its kernel rounds it), so the products are bit-identical.
    """
    return torch.tensor(1.0 / divisor, dtype=torch.float32)


@dataclass(frozen=True)
class StepPlan:
    """What one backward does, decided at its start (``plan_backward``); read by the hook, the launches, the end."""

    mode: str
    """COPY / ALIAS / VIEW (DDP's ``gradient_as_bucket_view``)."""
    divisor: int
    """The average's denominator: the world size, or the ranks still training under ``join``."""
    hooked: bool
    """A comm hook is registered (called, or fused): the buckets hold the local, undivided gradients."""
    fused: FusedCompression | None
    """The compress hook's average, run by the reducer (``fused_compress``); None where the hook is called."""
    flag_apart: bool
    """The missing-gradient flag needs an all-reduce of its own: a called hook (its buffer is only gradients),
    or a sparse last bucket (no spare element)."""
    one_in_flight: bool
    """A called hook not known to issue its collectives up front: one of its buckets in flight at a time."""
    copy_each: bool
    """COPY mode's common path may copy each bucket back right after its wait (if nothing else forbids it)."""
    nonfinite: NonfiniteCheck | None
    """The NaN/Inf check (``detect_nonfinite=True``), or None."""
    fast: list[FastEntry | None] | None
    """The hook's common-path table (``fast_table``), or None: every hook takes the slow path."""
    strategy: Any = None
    """The reducer's reduction strategy (``strategy.AllReduce`` or a subclass), whose points this backward runs."""
    drops_grads: bool = False
    """Each ``.grad`` goes as soon as its bucket holds it (ZeRO-2: a model's worth of gradients never lives at once);
    the common path does it too."""

    @property
    def checks_local(self) -> bool:
        """The non-finite check reads each bucket's local gradients before its launch (a comm hook's buckets, or
        ZeRO-2's, which no rank keeps whole), not the averages after the waits."""
        return self.hooked or (self.strategy is not None and self.strategy.shards_buckets)


def fused_now(
    fused: FusedCompression | None, nonfinite: NonfiniteCheck | None, has_sparse: bool
) -> FusedCompression | None:
    """The hook's average, run by the reducer; None where the hook is called (the NaN check's count needs it;
    a sparse gradient is the hook's to compress, as in torch)."""
    return fused if nonfinite is None and not has_sparse else None


def one_in_flight(comm_hook: Any, fused: FusedCompression | None) -> bool:
    """A called hook that may issue collectives from its callbacks (``launch_order``); not a fused one."""
    return comm_hook is not None and fused is None and not issues_collectives_up_front(comm_hook)


def plan_backward(
    *, mode: str, divisor: int, comm_hook: Any, fused: FusedCompression | None, nonfinite: NonfiniteCheck | None,
    has_sparse: bool, last_bucket_sparse: bool, tracks_usage: bool, fast: list[FastEntry | None] | None,
    strategy: Any = None,
) -> StepPlan:
    """The plan of the backward about to start (a synchronised one, or a joined rank's shadow of one), as
    ``strategy`` runs it (``AllReduce.plan``: ZeRO-2's shards take the reduce, its compression included)."""
    fused = fused_now(fused, nonfinite, has_sparse)
    plan = StepPlan(
        mode=mode,
        divisor=divisor,
        hooked=comm_hook is not None,
        fused=fused,
        flag_apart=(comm_hook is not None and fused is None) or last_bucket_sparse,
        one_in_flight=one_in_flight(comm_hook, fused),
        # Not where the non-finite check reads the local gradients after the waits, nor where unused parameters
        # must keep their .grad (``copy_back``).
        copy_each=mode == COPY and not tracks_usage and nonfinite is None,
        nonfinite=nonfinite,
        fast=fast,
        strategy=strategy,
    )
    return plan if strategy is None else strategy.plan(plan)


def fast_table(buckets: Sequence[Bucket], num_params: int, divisor: int, hooked: bool) -> list[FastEntry | None]:
    """Per parameter index, ``(bucket, slot, view, scale)`` for the hook's common path; None where the slow path must
    run anyway (a direct or sparse bucket). Built once per layout, divisor and comm hook (``cached_fast_table``).

    The common path (``Reducer`` decides when it applies: copies, no usage tracking, buckets rebuilt, no event
    log) is a subset of the slow path's steps, in the same order: give a freed bucket its memory back (ZeRO-2's,
    the same views), mark the slot, one fused scale-and-copy, drop ``.grad`` where the plan says
    (``drops_grads``), count down the bucket. So behaviour is the same by construction.
    """
    table: list[FastEntry | None] = [None] * num_params
    for bucket in buckets:
        if bucket.plan.direct or bucket.plan.sparse:
            continue  # large and rare (copy_in decides per backward whether it goes direct), or sparse
        for slot, (i, view) in enumerate(zip(bucket.plan.param_indices, bucket.views)):
            # A comm hook gets the local gradients as they are (as torch's); otherwise the 1/world-size
            # scaling rides on the copy (``copy_in``: the same multiply, so the same bits).
            scale = None if hooked else (reciprocal_f32(divisor) if view.dtype in FLOAT32_SCALED and view.is_cpu
                                         else 1.0 / divisor)
            table[i] = (bucket, slot, view, scale)
    return table


def cached_fast_table(cache: FastCache | None, layout_version: int, buckets: Sequence[Bucket], num_params: int,
                      divisor: int, hooked: bool) -> FastCache:
    """The common-path table for this layout, divisor and comm hook: ``cache`` where they are the ones it was built
    for, else a new one (``fast_table``, a Python loop over the parameters); the reducer keeps what this returns."""
    key = (layout_version, divisor, not hooked)
    if cache is not None and cache[0] == key:
        return cache
    return key, fast_table(buckets, num_params, divisor, hooked)


@dataclass(slots=True, eq=False)
class Backward:
    """What one backward fills in; ``Reducer.step`` from the backward's start to its end (None in between)."""

    plan: StepPlan
    pending: list[int]
    """Per bucket, gradients still to land; a bucket is full at 0."""
    order: Any
    """Which buckets are ready and which launched: in index order, the same on every rank (a ``reducer.LaunchOrder``:
    the reducer imports this module, not the other way)."""
    hooks_fired: bool = False
    """A parameter's hook ran in this backward (not only unused parameters marked)."""
    marked_unused: list[int] = field(default_factory=list)
    """What the backward's start marked unused (read by the gradient-twice error only)."""
    missing_flag: bool = False
    """Some parameter got no gradient: the flag this rank sends in the last bucket's spare element."""
    graph_grads: bool = False
    """A gradient carried a graph (``create_graph=True``): copy_back must record its copy."""
    fixups: int = 0
    """Slots whose ``.grad`` copy_back must still set (0 on the common path: ALIAS then copies nothing back)."""


def nothing_to_reduce(step: Backward, buckets: Sequence[Bucket]) -> bool:
    """No parameter got a gradient and nothing was launched: a torch.autograd.grad through the outputs (a gradient
    penalty, an adversarial attack), a loss that did not depend on the model (torch.func.functional_call with other
    tensors). Nothing to reduce, as in torch, and, as torch's reducer, still expecting this forward's backward: R1's
    loss.backward() after its autograd.grad."""
    return not step.hooks_fired and not any(any(b.seen) for b in buckets)
