"""ZeRO-2 inside the reducer: each bucket reduce-scattered, each rank stepping and keeping only its shard.

``DistributedDataParallel.zero_optimizer(optimizer_class, stage=2, **defaults)`` binds a ``ZeroShards`` to the
reducer and returns a ``ZeroOptimizer``. The one idea: a bucket's flat layout is also the layout of its shard.

* At binding, each bucket's parameters move into one flat buffer of their own, padded to a multiple of the world
  size (the parameters become views of it, as FSDP's flat parameters), and rank r's optimizer gets slice r of it
  as one flat parameter per bucket. The gradient buckets get the same padding (``BucketPlan.padded_numel``).
* In backward, gradients are copied into their buckets exactly as without ZeRO (the same multiply by 1/world
  size), and a full bucket lets go of its parameters' ``.grad``. Each bucket is **reduce-scattered** instead of
  all-reduced, in the same launch order: rank r receives slice r of the average, its shard's gradient, and the
  bucket's memory is freed as soon as that is done (``Bucket.free_storage``), reaped during backward where the
  collective finished already.
* ``opt.step()`` steps one bucket's shard at a time, the first layers' first, and launches its **all-gather** into
  the flat parameter buffer at once (in place: slice r is this rank's input), so each all-gather overlaps the steps
  after it and the next forward; a module's forward pre-hook waits for the buckets holding its own parameters
  (``strategy.register_waits``, shared with the overlapped step).

Which collectives carry them is one object (``zero2_wire.choose_collectives``): on NCCL and other backends
``reduce_scatter_tensor`` and ``all_gather_into_tensor``; on gloo, whose own pair is slow on CPU, an all-reduce of the
bucket with this rank's slice kept and one of the flat parameters with -0.0 elsewhere (twice the bytes), or the ring's
halves over send/recv on a thread and group of their own (a DDP step's bytes). ``LOCKSTEP_ZERO_COLLECTIVES=flat|
all_reduce|ring`` chooses; ``opt.collectives`` says.

At 2 ranks a reduce-scatter's sum is the all-reduce's (one addition of two values, whichever pair adds it), and an
element-wise optimizer computes the same bits on a flat slice as per parameter, so the parameters are plain DDP's bit
for bit; at 3 or more the sums may round differently (the padded buckets split into the ring's chunks elsewhere).
``clip_grad_norm_`` takes torch's per-parameter norms (``zero2_norm``): once it is in use, a bucket whose shards split
a parameter is all-reduced on every path, and its split parameters normed from that whole average in backward. Docs:
docs/ddp.md#zero-2-sharded-gradients-and-optimizer-state, docs/zero.md#clipping-the-gradient-norm.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.ddp.fused_compress import FusedCompression, narrow_in_place, wire_view
from lockstep.ddp.observe import Observer
from lockstep.ddp.reducer_state import Bucket, Status, slot_view
from lockstep.ddp.step import Backward, StepPlan
from lockstep.ddp.strategy import AllReduce, call_on
from lockstep.ddp.zero2_norm import (
    NormPlan,
    Request,
    SplitNorms,
    as_torchs_grad,
    clip_grads_,
    exchange_split,
    exchange_whole,
    param_norms,
    plan_norms,
    split_norms,
    total_norm,
)
from lockstep.ddp.zero2_wire import AllReducePair, ShardCollectives, choose_collectives
from lockstep.optim.state_parts import RANGE, SHAPE, STRIDE

# Buckets whose reduce-scatter may be in flight at once (their memory is held until it is done): a backward faster
# than the wire otherwise holds every bucket at its end, a model's worth of gradients ZeRO-2 means not to hold.
MAX_IN_FLIGHT = 2


def padded(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (equal shards)."""
    return -(-numel // world_size) * world_size


class ZeroShards(AllReduce):
    """ZeRO-2's reduction strategy and state: per bucket the flat parameter buffer, this rank's shard of it (a
    parameter the optimizer steps), the shard's gradient and the collectives in flight. Holds no reference to the
    reducer (the module's pre-hooks hold this object); ``owner`` is a weak reference to it, for its observer."""

    name = "ZeRO-2"
    waits_on = "reduce-scatter"
    # The hook's common path applies: it gives a freed bucket its memory back at its first write, as ``copy_in``
    # does, and drops .grad once copied (``StepPlan.drops_grads``), as ``copied`` does off it.
    shards_buckets = True
    keeps_layout = True  # a rebuild's new shards would leave the optimizer's state behind

    def __init__(self, group: dist.ProcessGroup, device: torch.device, owner: Callable[[], Any]):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.wire: ShardCollectives = choose_collectives(group, device)  # the reduce-scatter and all-gather
        self.whole = AllReducePair(group)  # a bucket whose average the clip needs whole (``issue``)
        self.owner = owner  # weakref.ref(reducer): its ``observer`` (a C call and an attribute read)
        self.compress: FusedCompression | None = None  # an fp16/bf16 compress hook's arithmetic on the wire
        self.joining = False  # inside DistributedDataParallel.join() (``set_joining``): the clip is refused there
        self.buckets: list[Bucket] = []
        self.param_flats: list[torch.Tensor] = []  # per bucket: every parameter's values, padded
        self.shards: list[nn.Parameter] = []  # per bucket: slice ``rank`` of its param_flat (a view)
        self.grads: list[torch.Tensor] = []  # per bucket: the shard's gradient storage (``.grad`` when it has one)
        self.location: list[tuple[int, int]] = []  # per parameter index: (bucket, slot)
        self.names: list[str] = []  # per parameter index: its name (the reducer's), for errors
        # per bucket in flight: (output, accumulate, the all-reduced whole bucket or None for a reduce-scatter)
        self._received: list[tuple[torch.Tensor, bool, torch.Tensor | None] | None] = []
        self._reaped: list[bool] = []  # per bucket: its reduce-scatter was finished this backward
        self.gathers: list[Any] = []  # per bucket: the all-gather in flight, or None
        self.gather_seq = 0  # all-gathers issued, the same count on every rank
        self.gather_seqs: list[int] = []  # per bucket: its all-gather's number (the hang report's collective #)
        self.step_bucket: Callable[[nn.Parameter], None] | None = None  # the optimizer's step of one shard
        self.unused: list[list[tuple[int, int]]] = []  # per bucket: shard ranges of parameters no rank used
        self.used: list[bool] | None = None  # per parameter index: some rank used it this backward (None: all)
        # clip_grad_norm_ (``zero2_norm``): which rank norms which parameter; the last clip's (norm_type, foreach),
        # once there is one backward norms the split parameters; per bucket those norms, and whether its shard's
        # gradient was zeroed in place since its last reduce (an add to zeros changes no norm)
        self.norm_plan = NormPlan({}, [], [], [])
        self.norm_request: Request | None = None
        self.split_cache: list[SplitNorms | None] = []
        self._zeroed: list[bool] = []
        self.params_by_index: dict[int, nn.Parameter] = {}
        self.optimizer_state: Callable[[nn.Parameter], dict[str, Any]] | None = None  # a shard's optimizer state
        self.handles: list[Any] = []  # the module's pre-hooks that wait for the all-gathers (``register_waits``)

    @property
    def kinds(self) -> tuple[str, str]:
        """The collectives that run (``zero2_wire.choose_collectives``): the reduce's and the gather's."""
        return self.wire.kinds

    # ----------------------------------------------------------------- the reducer's points (``strategy``)
    def take_hook(self, hook: Any, fused: FusedCompression | None) -> None:
        self.check_hook(hook, fused)
        self.compress = fused

    def at_forward_start(self, full: bool) -> None:
        if full:
            self.finish()  # the all-gathers of the last step: every parameter is read

    def backward_start(self, layout_version: int) -> tuple[list[int] | None, int | None]:
        self.finish()  # the last step's all-gathers (a forward not through the wrapper)
        return None, None

    def plan(self, plan: StepPlan) -> StepPlan:
        """The shards take the reduce (the compress hook's arithmetic included), the flag goes apart, nothing is
        copied back, each ``.grad`` goes once its bucket holds it (``copied``; the hook's common path too)."""
        return dataclasses.replace(plan, fused=None, flag_apart=True, one_in_flight=False, copy_each=False,
                                   drops_grads=True)

    def issue(self, bucket: Bucket, step: Backward, last: bool) -> Any:
        """The non-finite check on the local gradients (no rank keeps the average whole), then the reduce-scatter;
        the missing-gradient flag travels apart. Then the buckets launched before whose reduce-scatter is done go
        (their memory freed while backward runs), and at most ``MAX_IN_FLIGHT`` stay held by theirs."""
        plan = step.plan
        if plan.nonfinite is not None:
            plan.nonfinite.check_bucket(bucket, plan.divisor, True)
        b = bucket.index
        source = bucket.buffer[: bucket.plan.padded_numel]
        accumulate = self.shards[b].grad is not None  # a second synchronised backward before zero_grad: add, as .grad
        wire = source
        if self.compress is not None:  # the fp16/bf16 hook's arithmetic: cast, divide in the wire dtype, sum
            narrowed = wire_view(source, self.compress.dtype)
            if narrowed is None:
                narrowed = source.to(self.compress.dtype)
            else:
                narrow_in_place(source, narrowed)
            wire = narrowed
            wire.div_(self.compress.world_size)
        size = source.numel() // self.world_size
        out = torch.empty(size, dtype=wire.dtype, device=wire.device) if accumulate or wire is not source else None
        target = self.grads[b] if out is None else out
        self._reaped[b] = False
        # With clipping in use, a bucket whose shards split a parameter is all-reduced on every path: its whole
        # average is where the split parameters' norms are taken (``zero2_norm``); twice a reduce-scatter's bytes.
        pair = self.whole if self.norm_request is not None and self.norm_plan.split[b] else self.wire
        work, whole = pair.reduce_scatter(wire, target, f"bucket {b}")  # whole: this rank's slice copied at the end
        self._received[b] = (target, accumulate, whole)
        self._reap(step.order.next_index)  # this bucket's position: the ones before it are issued
        return work

    def wait(self, buckets: Sequence[Bucket], step: Backward, observer: Observer | None, copy_each: bool) -> float:
        """End of backward: wait for every bucket's reduce-scatter (the hang report names it); seconds waited. The
        averages land in the shards and each bucket's memory is freed."""
        waited = 0.0
        for bucket in buckets:
            if self._reaped[bucket.index]:
                continue
            if observer is not None:
                observer.wait_start(bucket.index, bucket.seq)
            start = time.perf_counter()
            bucket.work.wait()
            waited += time.perf_counter() - start
            if observer is not None:
                observer.wait_end(bucket.index, bucket.seq)
            self._finish_reduce(bucket)
        return waited

    def after_collectives(self, buckets: Sequence[Bucket], params: Sequence[nn.Parameter], status: Status,
                          step: Backward) -> None:
        if status.globally_used is not None or self.used is not None:  # else nothing was or is unused
            self.note_unused(status.globally_used)  # find_unused_parameters: skipped in the step; nothing into .grad

    def on_error(self) -> None:
        self.zero_grad(set_to_none=True)  # no shard keeps what raised: a step after it moves nothing

    def before_shadow(self) -> None:
        self.zero_grad(set_to_none=True)  # the training ranks' zero_grad: each shadow step is on its own round

    def after_shadow(self, status: Status) -> None:
        self.note_unused(status.globally_used)
        self.shadow_step()

    # ----------------------------------------------------------------- layout (once, at binding)
    def take_layout(self, buckets: Sequence[Bucket], location: Sequence[tuple[int, int]],
                    names: Sequence[str] = ()) -> None:
        """The parameters of each bucket into one padded flat buffer (each becomes a view of its slot), and this
        rank's slice of it as the bucket's shard parameter. ``names``: the parameters' (the reducer's order)."""
        if self.buckets:
            raise RuntimeError("zero_optimizer: the bucket layout changed after binding (ZeRO-2 keeps its layout)")
        self.buckets, self.location, self.names = list(buckets), list(location), list(names)
        for bucket in buckets:
            plan = bucket.plan
            flat = torch.zeros(plan.padded_numel, dtype=plan.dtype, device=plan.device)
            with torch.no_grad():
                for p, offset in zip(bucket.params, plan.offsets):
                    view = slot_view(flat, offset, p)
                    view.copy_(p)
                    p.data = view  # the parameter object stays (optimizers, hooks, names): its memory is the slot
            size = plan.padded_numel // self.world_size
            self.param_flats.append(flat)
            self.shards.append(nn.Parameter(flat[self.rank * size:(self.rank + 1) * size]))
            self.grads.append(torch.zeros(size, dtype=plan.dtype, device=plan.device))
        self._received = [None] * len(buckets)
        self._reaped = [False] * len(buckets)
        self.gathers = [None] * len(buckets)
        self.gather_seqs = [0] * len(buckets)
        self.unused = [[] for _ in buckets]
        self.norm_plan = plan_norms(buckets, self.world_size)
        self.split_cache = [None] * len(buckets)
        self._zeroed = [False] * len(buckets)
        self.params_by_index = {i: p for bucket in buckets for i, p in zip(bucket.plan.param_indices, bucket.params)}

    # ----------------------------------------------------------------- backward: reduce-scatter, reap, free
    def copied(self, param: nn.Parameter, bucket: Bucket, slot: int) -> None:
        """The parameter's gradient is in its bucket: its ``.grad`` goes now, not at the end of backward (ZeRO-2's
        memory: a model's worth of gradients never lives at once). The NaN check reads the bucket's copy."""
        param.grad = None
        bucket.grads[slot] = None

    def _reap(self, launched: int) -> None:
        """During backward, at a bucket's launch (its position ``launched``): finish the buckets before it whose
        reduce-scatter has completed, so their memory goes while backward still runs; then, with this one, at most
        ``MAX_IN_FLIGHT`` stay held by theirs: wait for the oldest beyond that (waits only, in index order: no
        collective, so every rank's sequence stays the same)."""
        pending = []
        for bucket in self.buckets[:launched]:
            work = bucket.work
            if work is not None and not self._reaped[bucket.index]:
                if work.is_completed():
                    self._finish_reduce(bucket)
                else:
                    pending.append(bucket)
        for bucket in pending[: max(0, len(pending) - (MAX_IN_FLIGHT - 1))]:
            self._finish_reduce(bucket)

    def _finish_reduce(self, bucket: Bucket) -> None:
        b = bucket.index
        bucket.work.wait()  # completed already where reaped: returns at once
        received = self._received[b]
        assert received is not None
        target, accumulate, whole = received
        self._received[b] = None
        if whole is not None:  # an all-reduce's whole average: this rank's slice is the shard's
            size = target.numel()
            target.copy_(whole[self.rank * size:(self.rank + 1) * size])
        self._reaped[b] = True
        grad = self.grads[b]
        if accumulate:
            grad.add_(target.to(grad.dtype) if target.dtype != grad.dtype else target)
        elif target is not grad:
            grad.copy_(target)  # the wire dtype back in the parameters' (the compress hook's cast back)
        self.shards[b].grad = grad
        if self.norm_request is not None or self.split_cache[b] is not None or self._zeroed[b]:
            self._keep_split_norms(b, whole, grad, accumulate)
        bucket.work = None  # it holds the buffer: the memory goes with the storage below
        bucket.free_storage()

    def _keep_split_norms(self, b: int, whole: torch.Tensor | None, grad: torch.Tensor, accumulate: bool) -> None:
        """With clipping in use: the norms of the bucket's split parameters, from its ``whole`` average while it is
        here (an all-reduce's; a reduce-scatter leaves none), as ``clip_grad_norm_`` will want them. A pass over
        those parameters' elements each backward; none where nothing is clipped."""
        self.split_cache[b] = None
        entries, request = self.norm_plan.split[b], self.norm_request
        if request is not None and entries and whole is not None and (not accumulate or self._zeroed[b]):
            norms = split_norms(whole, entries, self.params_by_index, request, grad.dtype)
            self.split_cache[b] = SplitNorms(request, grad, grad._version, norms)
        self._zeroed[b] = False

    def note_unused(self, globally_used: Sequence[bool] | None) -> None:
        """find_unused_parameters, at the end of a backward: the parts of this rank's shards that belong to
        parameters no rank used, which plain DDP's optimizer skips (their ``.grad`` stays None)."""
        self.unused = [[] for _ in self.buckets]
        self.used = None if globally_used is None else list(globally_used)
        if globally_used is None:
            return
        for b, bucket in enumerate(self.buckets):
            size = self.shards[b].numel()
            start = self.rank * size
            for i, offset, p in zip(bucket.plan.param_indices, bucket.plan.offsets, bucket.params):
                lo, hi = max(offset, start), min(offset + p.numel(), start + size)
                if not globally_used[i] and lo < hi:
                    self.unused[b].append((lo - start, hi - start))

    # ----------------------------------------------------------------- the step and the all-gathers
    def step_and_gather(self, step_bucket: Callable[[nn.Parameter], None]) -> None:
        """``opt.step()``: each bucket's shard stepped (``step_bucket``) where it has a gradient, then its
        all-gather issued at once, from the last bucket back on every rank: the buckets are in backward's order, so
        the last holds the first layers, which the next forward waits for first."""
        self.finish()  # a step with no forward since the last one: its parameters first
        self._check_views()
        observer = getattr(self.owner(), "observer", None)
        if observer is not None:
            observer.collective("all-gather")  # the hang report names it
        for b in reversed(range(len(self.shards))):
            shard = self.shards[b]
            if shard.grad is not None and self.unused[b]:
                self._step_skipping(b, step_bucket)
            elif shard.grad is not None:
                step_bucket(shard)
            self.gather_seq += 1
            self.gather_seqs[b] = self.gather_seq
            self.gathers[b] = self.wire.all_gather(self.param_flats[b], shard, f"bucket {b}")

    def check_hook(self, hook: Any, fused: FusedCompression | None) -> None:
        """ZeRO-2 runs a comm hook's arithmetic itself, which it can for the fp16/bf16 compress hooks only."""
        if hook is not None and fused is None:
            name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)
            raise ValueError(f"zero_optimizer: comm hook {name!r} is not supported with ZeRO-2 (its buckets are "
                             "reduce-scattered by the reducer); only the fp16/bf16 compress hooks are")

    def shadow_step(self) -> None:
        """A joined rank's stand-in for ``opt.step()`` after its shadow backward (``join``): its shards hold the
        training ranks' average, and they all-gather its slices; stepped and gathered at once."""
        assert self.step_bucket is not None
        self.step_and_gather(self.step_bucket)
        self.finish()

    def _check_views(self) -> None:
        """Every parameter still lives in its bucket's flat buffer, where the all-gather writes; one pointer
        comparison a parameter per step. ``module.to(...)``, ``.half()`` or a ``p.data = ...`` after binding gives a
        parameter new storage, which the step would silently stop updating: a one-line error naming it instead."""
        for bucket, flat in zip(self.buckets, self.param_flats):
            base = flat.untyped_storage().data_ptr()
            for i, p in zip(bucket.plan.param_indices, bucket.params):
                if p.untyped_storage().data_ptr() != base:
                    name = self.names[i] if i < len(self.names) else f"#{i}"
                    raise RuntimeError(
                        f"zero_optimizer: parameter {name!r} no longer lives in its ZeRO-2 bucket (moved or cast, "
                        "e.g. module.to() or .half(), after zero_optimizer); move or cast the model before "
                        "wrapping it and calling zero_optimizer")

    def _step_skipping(self, b: int, step_bucket: Callable[[nn.Parameter], None]) -> None:
        """Step shard ``b``, leaving the parts no rank used as they were (values and per-element state), as plain
        DDP's optimizer skips a parameter whose ``.grad`` is None. A shard's step count still advances."""
        shard, ranges = self.shards[b], self.unused[b]
        if sum(hi - lo for lo, hi in ranges) == shard.numel():
            return  # nothing in it was used: skipped whole, step count included
        state = self.optimizer_state(shard) if self.optimizer_state is not None else {}
        had_state = bool(state)
        saved = [(lo, hi, shard.detach()[lo:hi].clone(),
                  {k: v[lo:hi].clone() for k, v in state.items() if _per_element(v, shard)}) for lo, hi in ranges]
        step_bucket(shard)
        state = self.optimizer_state(shard) if self.optimizer_state is not None else {}
        with torch.no_grad():
            for lo, hi, values, kept in saved:
                shard[lo:hi] = values
                for k, v in state.items():
                    if _per_element(v, shard):
                        v[lo:hi] = kept[k] if had_state and k in kept else 0  # no state yet: as a fresh one

    def in_flight(self) -> bool:
        return any(work is not None for work in self.gathers)

    def finish_params(self, indices: Sequence[int]) -> None:
        """Wait for the all-gathers of the buckets holding these parameters (a module's forward pre-hook)."""
        if not any(self.gathers):  # nothing in flight (a Work is truthy): C's any, no call of ours
            return
        for b in sorted({self.location[i][0] for i in indices}):
            self._finish_gather(b)

    def finish(self) -> None:
        """Wait for every all-gather still in flight: every parameter holds the last step's values."""
        for b in range(len(self.gathers)):
            self._finish_gather(b)

    def _finish_gather(self, b: int) -> None:
        work = self.gathers[b]
        if work is None:
            return
        observer = getattr(self.owner(), "observer", None)
        if observer is not None:
            observer.collective("all-gather")  # the hang report names it
            observer.wait_start(b, self.gather_seqs[b])
        work.wait()
        self.gathers[b] = None
        if observer is not None:
            observer.wait_end(b, self.gather_seqs[b])

    # ----------------------------------------------------------------- gradients and norms
    def set_joining(self, joining: bool) -> None:  # DistributedDataParallel.join()'s context, entered and left
        self.joining = joining

    def zero_grad(self, set_to_none: bool) -> None:
        for b, shard in enumerate(self.shards):
            if set_to_none:
                shard.grad = None
            elif shard.grad is not None:
                shard.grad.zero_()
                self._zeroed[b] = True

    def grad_norms(self, request: Request) -> dict[int, torch.Tensor]:
        """Per parameter with a gradient (reducer index -> norm): its norm over its whole averaged gradient, as
        torch's ``clip_grad_norm_`` takes it (``zero2_norm``): the whole ones' from their owners, the split ones'
        from backward, or exchanged now where any rank lacks them. Every rank calls it at the same point."""
        self.norm_request = request  # from now on, backward norms the split parameters
        has_grad = {i: shard.grad is not None and (self.used is None or self.used[i])
                    for bucket, shard in zip(self.buckets, self.shards) for i in bucket.plan.param_indices}
        # Exchange the pieces unless backward's norms hold for every bucket: decided from state every rank shares
        # (the same clips, the same in-place changes of the same gradients), so every rank issues the same collectives
        held = [not entries or shard.grad is None or (cache is not None and cache.holds(request, shard.grad))
                for entries, shard, cache in zip(self.norm_plan.split, self.shards, self.split_cache)]
        exchange = not all(held)
        whole = exchange_whole(self.norm_plan, self._own_norms(request, has_grad), self.group)
        norms = {i: n for i, n in whole.items() if has_grad[i]}
        for b, (entries, shard, cache) in enumerate(zip(self.norm_plan.split, self.shards, self.split_cache)):
            if not entries or shard.grad is None:  # the same on every rank: each exchange below is on all of them
                continue
            if exchange:
                got = exchange_split(shard.grad, self.rank * shard.numel(), entries, self.norm_plan.packed_numel[b],
                                     self.params_by_index, self.group, request)
            else:
                assert cache is not None
                got = cache.norms
            norms.update((i, n) for i, n in got.items() if has_grad[i])
        return norms

    def _own_norms(self, request: Request, has_grad: dict[int, bool]) -> dict[int, torch.Tensor]:
        """The norms of the parameters this rank's shards hold whole, one foreach call a (device, dtype)."""
        kinds: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        for bucket, shard in zip(self.buckets, self.shards):
            start, grad = self.rank * shard.numel(), shard.grad
            for i, offset, p in zip(bucket.plan.param_indices, bucket.plan.offsets, bucket.params):
                if grad is not None and self.norm_plan.owners[i] == self.rank and has_grad[i]:
                    indices, views = kinds.setdefault((p.device, p.dtype), ([], []))
                    indices.append(i)
                    views.append(as_torchs_grad(slot_view(grad, offset - start, p)))
        mine: dict[int, torch.Tensor] = {}
        for indices, views in kinds.values():
            mine.update(zip(indices, param_norms(views, *request)))
        return mine


def _per_element(value: Any, shard: torch.Tensor) -> bool:
    """A state value with one entry per element of the shard (momentum, Adam's moments), not a count."""
    return isinstance(value, torch.Tensor) and value.shape == shard.shape and value.dim() == 1


# Optimizers whose update of an element reads other elements (a norm, a factored second moment, a line search):
# on a flat shard they would compute something else.
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "SparseAdam", "ZeroRedundancyOptimizer")


def check_optimizer_class(optimizer_class: Any) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        got = optimizer_class.__name__ if isinstance(optimizer_class, type) else f"a {type(optimizer_class).__name__}"
        raise TypeError("zero_optimizer: optimizer_class must be a torch.optim.Optimizer subclass (the class, not "
                        f"an instance), got {got}")
    if optimizer_class.__name__ in _NOT_ELEMENTWISE:
        raise ValueError(f"zero_optimizer: {optimizer_class.__name__} does not update each element on its own, so it "
                         "cannot step a flat shard; use an element-wise optimizer (SGD, Adam, AdamW, RMSprop, ...)")


class ZeroOptimizer(torch.optim.Optimizer):
    """What ``DistributedDataParallel.zero_optimizer`` returns: ``optimizer_class`` over this rank's shards.

    An ordinary ``torch.optim.Optimizer`` to the loop and to LR schedulers (``param_groups`` are the inner
    optimizer's, one group); ``step()`` steps each bucket's shard and launches its all-gather; ``zero_grad``
    clears the shards' gradients and the parameters' own (left by ``no_sync`` micro-batches). ``state_dict()`` is
    this rank's shard; ``consolidate_state_dict(to)`` is a plain torch optimizer's state dict of the whole model.
    """

    def __init__(self, shards: ZeroShards, optimizer_class: type[torch.optim.Optimizer],
                 params: Sequence[nn.Parameter], module_params: Sequence[nn.Parameter], defaults: dict[str, Any]):
        check_optimizer_class(optimizer_class)
        self._shards = shards
        self._inner = optimizer_class(list(shards.shards), **defaults)
        self._params = list(params)  # the DDP's (the reducer's order)
        index = {id(p): i for i, p in enumerate(module_params)}
        self._module_index = [index[id(p)] for p in self._params]  # a plain optimizer's param ids
        # reducer indices in model.parameters() order: the order torch's clip_grad_norm_ stacks the norms in
        self._module_order = sorted(range(len(self._params)), key=self._module_index.__getitem__)
        torch.optim.Optimizer.__init__(self, list(shards.shards), self._inner.defaults)  # hooks, the profiler's name
        self._share_inner()  # one list of groups: a scheduler's writes reach the inner optimizer
        shards.step_bucket = self._step_bucket
        shards.optimizer_state = lambda shard: self._inner.state.get(shard, {})
        self._built = True

    @property
    def collectives(self) -> tuple[str, str]:
        """Which reduce and gather run (``zero2_wire``): ("reduce_scatter_tensor", "all_gather_into_tensor"), the
        all-reduce pair's ("all_reduce, slice kept", "all_reduce, -0.0 elsewhere") or the ring's ("ring
        reduce-scatter (send/recv)", "ring all-gather (send/recv)")."""
        return self._shards.kinds

    def _step_bucket(self, shard: nn.Parameter) -> None:
        call_on(self._inner, functools.partial(operator.is_, shard), self._inner.step)  # C calls: p is shard

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every shard that has a gradient and launch the all-gathers (waited for in the next forward)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._shards.step_and_gather(self._step_bucket)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._shards.zero_grad(set_to_none)
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_built", False):  # torch.optim.Optimizer.__init__'s own call
            super().add_param_group(param_group)
            return
        raise NotImplementedError("zero_optimizer: one parameter group over the DDP's parameters (each bucket is one "
                                  "flat shard); add_param_group is not supported")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` over the whole model's averaged gradient, held
        in shards, with torch's bits (``zero2_norm``): each parameter's norm over its whole gradient, the norm of
        those in the model's order, the same coefficient on every shard. One all-reduce of a value a parameter, no
        host sync; from the first call on, backward norms the parameters the shards split. Returns the total norm.
        Refused inside ``join()`` (on every rank at the first clip, while all still train): a rank out of data would
        not take part in that all-reduce, which would meet its next collective and abort the process."""
        if self._shards.joining:
            raise RuntimeError("zero_optimizer.clip_grad_norm_: not inside DistributedDataParallel.join(): a rank that "
                               "runs out of data cannot take part in the norm's all-reduce; clip outside join(), or "
                               "give every rank the same number of batches")
        norm_type = float(norm_type)
        norms = self._shards.grad_norms((norm_type, foreach))
        total = total_norm([norms[i] for i in self._module_order if i in norms], norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"zero_optimizer.clip_grad_norm_: the total norm of order {norm_type} is non-finite")
        clip_grads_([s.grad for s in self._shards.shards if s.grad is not None], max_norm, total, foreach)
        return total

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the inner optimizer's state dict with what it was sharded over (``load_state_dict``
        checks it)."""
        return {"zero_stage": 2, "world_size": self._shards.world_size, "rank": self._shards.rank,
                "shard_numels": [s.numel() for s in self._shards.shards], "optimizer": self._inner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A ``state_dict()`` of this rank at the same world size and layout, or a plain torch optimizer's state
        dict of the whole model (``consolidate_state_dict``'s, or one saved without ZeRO): sliced into shards."""
        if "zero_stage" not in state_dict:
            self._load_full(state_dict)
            self._share_inner()
            return
        mine = [s.numel() for s in self._shards.shards]
        if (state_dict["world_size"], state_dict["rank"], state_dict["shard_numels"]) != (
                self._shards.world_size, self._shards.rank, mine):
            raise ValueError(
                f"zero_optimizer.load_state_dict: a shard of rank {state_dict['rank']} of {state_dict['world_size']} "
                f"(shards {state_dict['shard_numels'][:4]}...) does not fit rank {self._shards.rank} of "
                f"{self._shards.world_size} (shards {mine[:4]}...); load a consolidate_state_dict() instead")
        self._inner.load_state_dict(state_dict["optimizer"])
        self._share_inner()

    def _share_inner(self) -> None:
        """The inner optimizer's groups and state as this one's (its load_state_dict made new ones)."""
        self.param_groups, self.state = self._inner.param_groups, self._inner.state

    def consolidate_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Every rank calls it; rank ``to`` (in the DDP's group) gets the whole model's state as a plain
        ``optimizer_class(model.parameters())`` would hold it (one all-gather per bucket and state tensor), the
        others None. Loads into a plain torch optimizer, or into a ZeroOptimizer at any world size."""
        shards = self._shards
        state: dict[int, dict[str, Any]] = {}
        for b, (bucket, shard) in enumerate(zip(shards.buckets, shards.shards)):
            for key, value in sorted(self._inner.state.get(shard, {}).items()):
                if isinstance(value, torch.Tensor) and value.shape == shard.shape and shard.dim() == 1:
                    full = torch.empty(shards.param_flats[b].numel(), dtype=value.dtype, device=value.device)
                    shards.wire.gather_state(full, value)
                    per_param = [slot_view(full, o, p).clone() for o, p in zip(bucket.plan.offsets, bucket.params)]
                else:  # a scalar (Adam's step) or a Python value: the same for every parameter of the shard
                    per_param = [value.clone() if isinstance(value, torch.Tensor) else value for _ in bucket.params]
                for i, v in zip(bucket.plan.param_indices, per_param):
                    state.setdefault(self._module_index[i], {})[key] = v
        if dist.get_rank(shards.group) != to:
            return None
        group = {k: v for k, v in self._inner.param_groups[0].items() if k != "params"}
        group["params"] = sorted(self._module_index)
        return {"state": dict(sorted(state.items())), "param_groups": [group]}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard as a checkpoint part (``lockstep.optim.state_parts``): per parameter of the model, the
        element range of it this rank holds and that range of each per-element state, in a plain optimizer's
        numbering. No collective; every rank's parts merge into ``consolidate_state_dict``'s dict at any world size."""
        shards = self._shards
        state: dict[int, dict[str, Any]] = {}
        for bucket, shard in zip(shards.buckets, shards.shards):
            lo, hi = shards.rank * shard.numel(), (shards.rank + 1) * shard.numel()
            inner = self._inner.state.get(shard, {})
            for i, p, offset in zip(bucket.plan.param_indices, bucket.params, bucket.plan.offsets):
                start, end = max(lo, offset), min(hi, offset + p.numel())
                if start >= end or not inner:
                    continue  # none of this parameter is in this rank's shard (or nothing is stepped yet)
                entry: dict[str, Any] = {RANGE: (start - offset, end - offset), SHAPE: tuple(p.shape),
                                         STRIDE: None if p.is_contiguous() else tuple(p.stride())}
                for key, value in inner.items():
                    entry[key] = (value[start - lo:end - lo].detach().cpu().clone() if _per_element(value, shard)
                                  else value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value)
                state[self._module_index[i]] = entry
        group = {k: v for k, v in self._inner.param_groups[0].items() if k != "params"}
        group["params"] = sorted(self._module_index)
        return {"state": dict(sorted(state.items())), "param_groups": [group]}

    def load_sharded_state_dict(self, part: dict[str, Any]) -> None:
        """This rank's own part (``sharded_state_dict`` at the same world size and layout) back into its shards."""
        shards = self._shards
        inner_state: dict[int, dict[str, Any]] = {}
        for b, (bucket, shard) in enumerate(zip(shards.buckets, shards.shards)):
            lo = shards.rank * shard.numel()
            for i, offset in zip(bucket.plan.param_indices, bucket.plan.offsets):
                entry = part["state"].get(self._module_index[i])
                if entry is None:
                    continue
                start, end = entry[RANGE][0] + offset, entry[RANGE][1] + offset
                target = inner_state.setdefault(b, {})
                for key, value in entry.items():
                    if not isinstance(key, str) or key.startswith("lockstep_"):
                        continue
                    if isinstance(value, torch.Tensor) and value.dim() == 1:
                        flat = target.setdefault(key, torch.zeros(shard.numel(), dtype=value.dtype))
                        flat[start - lo:end - lo] = value
                    else:
                        target[key] = value
        group = dict(part["param_groups"][0], params=list(range(len(shards.shards))))
        self._inner.load_state_dict({"state": inner_state, "param_groups": [group]})
        self._share_inner()

    def _load_full(self, state_dict: dict[str, Any]) -> None:
        """A whole model's plain state dict, each bucket's slice ``rank`` taken into its shard."""
        shards = self._shards
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"zero_optimizer.load_state_dict: {len(groups)} parameter groups; a ZeRO optimizer has 1")
        full_state = state_dict["state"]
        inner_state: dict[int, dict[str, Any]] = {}
        for b, bucket in enumerate(shards.buckets):
            ids = [self._module_index[i] for i in bucket.plan.param_indices]
            keys = set().union(*(full_state.get(j, full_state.get(str(j), {})).keys() for j in ids))
            for key in sorted(keys):
                values = [full_state.get(j, full_state.get(str(j), {})).get(key) for j in ids]
                first = values[0]
                per_element = key != "step" and all(
                    isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, bucket.params))
                if per_element:
                    assert isinstance(first, torch.Tensor)
                    flat = torch.zeros(shards.param_flats[b].numel(), dtype=first.dtype)
                    for o, p, v in zip(bucket.plan.offsets, bucket.params, values):
                        slot_view(flat, o, p).copy_(v)
                    size = flat.numel() // shards.world_size
                    value: Any = flat[shards.rank * size:(shards.rank + 1) * size].clone()
                else:
                    value = first
                inner_state.setdefault(b, {})[key] = value
        group = dict(groups[0], params=list(range(len(shards.shards))))
        self._inner.load_state_dict({"state": inner_state, "param_groups": [group]})

