"""The optimizer step overlapped with the next forward: each bucket's parameters updated where they are first needed.

A DDP step can start sending gradients only after its forward, and the next forward can start only after the last
bucket's average is back and the optimizer has stepped: on a link slower than the backward, the step is at least
forward + all-reduce. But the next forward needs the *first* layers first, whose gradients a reverse-ordered DDP
sends *last*. So, once bound (``DistributedDataParallel.overlap_optimizer_step``):

* ``opt.step()`` returns at once, noting the step (and the hyperparameters it would use: an LR scheduler stepped
  after it does not reach this step); ``opt.zero_grad()`` is noted too for the parameters still in flight.
* The end of backward issues the buckets still held back and returns without waiting (``Reducer._finalize_backward``).
* The next forward waits, in a pre-hook of each module that owns parameters, only for that module's buckets: each
  bucket's average is copied into ``.grad`` and the optimizer steps that bucket's parameters alone (the same
  optimizer, its ``param_groups`` narrowed for the call), then the noted ``zero_grad`` applies to them. The end of
  the forward finishes what it did not use.
* Buckets launch in a fixed sequence (``launch_order.priority_sequence``): those the wire can carry during backward
  in index order, then the rest from the last (the first layers) back, so the first layers' averages are not stuck
  behind large late ones. How many go first is measured on the plain order's rounds and agreed by one all-reduce
  (the minimum over ranks) at a round boundary, so every rank issues the same sequence.

For an element-wise optimizer (SGD, momentum, Adam, AdamW, ...) the update of each parameter is the same arithmetic
on the same numbers as a full ``opt.step()``, so the parameters are bit-identical to plain DDP's. What it changes in
a script, and what forces a full wait (``finish``): docs/ddp.md#overlapping-the-optimizer-step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lockstep.ddp.buckets import MIB
from lockstep.ddp.config import DEFAULT_BUCKET_CAP_MB
from lockstep.ddp.errors import raise_missing_gradients
from lockstep.ddp.launch_order import priority_sequence
from lockstep.ddp.reducer_state import Bucket, Status
from lockstep.ddp.step import COPY, Backward
from lockstep.ddp.strategy import AllReduce, call_on, copy_back_path, register_waits, wait_bucket

Reducer = Any  # lockstep.ddp.reducer.Reducer, which imports this module

# Rounds timed in the plain order (after the bucket rebuild and the auto-tuner) before the sequence is agreed.
MEASURED_ROUNDS = 2
# With the default cap, the rebuilt layout holds at least this many buckets (each >= 1 MiB): a model whose gradients
# fit one 25 MB bucket has nothing to send first (the link's transformer, 7.9 MB: 1 bucket, no gain; 1 MB: 8).
OVERLAP_MIN_BUCKETS = 8
# Optimizers whose step is not one element-wise update per parameter: every step needs every gradient.
_WHOLE_STEP_OPTIMIZERS = ("LBFGS", "ZeroRedundancyOptimizer")


def check_can_overlap(reducer: Reducer, optimizer: Any) -> None:
    """Refuse, with a one-line reason naming the argument, what the overlapped step cannot do exactly."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"overlap_optimizer_step: optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    if type(optimizer).__name__ in _WHOLE_STEP_OPTIMIZERS:
        raise ValueError(f"overlap_optimizer_step: {type(optimizer).__name__} steps with a closure over every "
                         "gradient at once; nothing can overlap: use the plain step")
    if reducer.grad_mode != COPY:
        raise ValueError("overlap_optimizer_step needs gradient_as_bucket_view=False (the default): with bucket "
                         "views .grad is the buffer still on the wire")
    if reducer.usage.find_unused or reducer.usage.static_graph:
        raise ValueError("overlap_optimizer_step does not support find_unused_parameters=True or static_graph=True "
                         "(their status exchange needs every bucket first)")
    if reducer.nonfinite is not None and not reducer.nonfinite.pre_launch:
        raise ValueError("overlap_optimizer_step with detect_nonfinite=True needs a world size that is a power of two "
                         f"(the verdict checked before the launches), not {reducer.world_size}")


class _Round:
    """One deferred backward: its buckets in flight, which are finished, the seconds waited."""

    __slots__ = ("step", "done", "left", "waited_s", "flag_checked")

    def __init__(self, step: Backward, num_buckets: int):
        self.step = step
        self.done = [False] * num_buckets
        self.left = num_buckets
        self.waited_s = 0.0
        self.flag_checked = False


class OverlappedStep(AllReduce):
    """The optimizer bound to one reducer: deferred ``step``/``zero_grad``, per-module waits, the launch sequence."""

    name = "overlapped step"
    defers = True

    def __init__(self, reducer: Reducer, optimizer: torch.optim.Optimizer, module: nn.Module,
                 sent_during_backward_mb: float | None = None):
        check_can_overlap(reducer, optimizer)
        self.reducer = reducer
        self.optimizer = optimizer
        self.round: _Round | None = None
        self.step_hyperparams: list[dict[str, Any]] | None = None  # the noted opt.step()'s, None: none noted
        self.zero_set_to_none: bool | None = None  # the noted opt.zero_grad()'s argument, None: none noted
        self.sequence: list[int] | None = None  # agreed launch sequence; None: index order
        self.sequence_layout = 0  # the reducer's layout_version the sequence is for
        self.fixed_bytes = None if sent_during_backward_mb is None else int(sent_during_backward_mb * 2**20)
        self._timings: list[tuple[int, float, float, float]] = []  # (layout, first launch, drain, last done) s
        self._drain_s = 0.0
        self._warned: set[str] = set()
        self._step, self._zero_grad = optimizer.step, optimizer.zero_grad  # bound: a scheduler's wrapper, if made
        self._stepping = False  # inside our own call of the user's step: its pre-hook lets it through
        self._hook = optimizer.register_step_pre_hook(self._refuse_direct_step)
        self._split_default_buckets()
        self._handles = register_waits(module, reducer.params, self.finish_params, self.finish)

    def _split_default_buckets(self) -> None:
        """With the default cap (25 MB, torch's; not "auto") and before the rebuild, cap the rebuilt buckets so that
        there are ``OVERLAP_MIN_BUCKETS`` (the same arithmetic on every rank: the same layout)."""
        reducer = self.reducer
        caps = reducer.caps
        if (caps.cap_mb != DEFAULT_BUCKET_CAP_MB or caps.cap_mb_list is not None or caps.auto is not None
                or reducer.buckets_rebuilt):
            return
        nbytes = sum(p.numel() * p.element_size() for p in reducer.params)
        cap = max(MIB, nbytes // OVERLAP_MIN_BUCKETS)
        reducer.limit_caps(cap)  # the rebuild's first bucket too

    # ----------------------------------------------------------------- the optimizer's methods, deferred
    def _refuse_direct_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The user's optimizer stepped directly while bound (its step pre-hook): its gradients may still be on the
        wire. Our own calls (``_call_step``) pass."""
        if not self._stepping:
            raise RuntimeError(f"{type(optimizer).__name__}.step() was called on the optimizer given to "
                               "overlap_optimizer_step; step the optimizer it returned (its .grad may still be on the "
                               "wire until then): opt = model.overlap_optimizer_step(opt)")

    def _call_step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._stepping = True
        try:
            return self._step(closure) if closure is not None else self._step()
        finally:
            self._stepping = False

    def note_step(self, closure: Callable[[], Any] | None) -> Any:
        """``opt.step()``: with a round in flight, note it (and its hyperparameters) and return; else step now."""
        if closure is not None or self.round is None or self.step_hyperparams is not None:
            self.finish()  # a closure re-evaluates the loss; a second step in one round steps on the same grads
            return self._call_step(closure)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # an LR scheduler checks it (torch)
        self.step_hyperparams = [{k: _snapshot(v) for k, v in g.items() if k != "params"}
                                 for g in self.optimizer.param_groups]
        self._update_foreign()
        for b, done in enumerate(self.round.done):
            if done:  # finished before the step was noted (a full wait asked for them): update them now
                self._update(self.reducer.buckets[b].params)
        return None

    def note_zero_grad(self, set_to_none: bool) -> None:
        """``opt.zero_grad()``: the parameters still in flight are zeroed after their update; the others now."""
        if self.round is None or self.step_hyperparams is None:
            self.finish()  # no step noted: dropping a round's gradients unstepped is what the user asked for
            self._zero_grad(set_to_none)
            return
        self.zero_set_to_none = set_to_none
        pending = {id(p) for b, done in zip(self.reducer.buckets, self.round.done) if not done for p in b.params}
        self._call_on(lambda p: id(p) not in pending, lambda: self._zero_grad(set_to_none))

    # ----------------------------------------------------------------- the reducer's points (``strategy``)
    def refuse_join(self) -> str | None:
        return ("DistributedDataParallel.join: not with overlap_optimizer_step (a joined rank's stand-in backwards "
                "do not defer); use the plain step for uneven inputs")

    def round_in_flight(self) -> bool:
        return self.round is not None

    def held_backward(self) -> Backward | None:
        return None if self.round is None else self.round.step

    def backward_start(self, layout_version: int) -> tuple[list[int] | None, int | None]:
        """A backward starts: a round still in flight (a backward with no forward through the wrapper) finished;
        then, the last round finished on every rank, agree once per layout on the sequence. Here, before any bucket
        of this backward and after every collective of the last step's, the agreement's place among the
        collectives is the same on every rank, whichever rounds each deferred. Returns the agreed sequence (None:
        index order, before the agreement) and where a backward in it stops launching: after the carrier (the last
        bucket, first of the held ones) and the one after it; the next forward launches the rest one by one
        (``_finish_bucket``)."""
        self.finish()
        agreed = self._maybe_agree()
        if agreed is not None:
            self._read_agreement(agreed)
        if self.sequence is None or self.sequence_layout != layout_version:
            return None, None
        return self.sequence, self.sequence.index(len(self.sequence) - 1) + 2

    def defer(self, step: Backward, missing: list[int]) -> bool:
        """End of a backward, launched up to its window (``launch_sequence``): keep the round in flight and return True,
        or False where this round must be finished now (every bucket launched here; the reducer then waits as
        without the option)."""
        reducer = self.reducer
        self._drain_s = time.perf_counter()
        step.order.drain()  # up to the window
        if not self._deferrable(step, missing):
            step.order.stop = len(reducer.buckets)
            step.order.drain()
            return False
        self.round = _Round(step, len(reducer.buckets))
        return True

    def _deferrable(self, step: Backward, missing: list[int]) -> bool:
        reducer = self.reducer
        plan = step.plan
        fast, _ = copy_back_path(step)
        # COPY mode without usage tracking; the non-finite check's verdict is read before any copy (``_check_flag``).
        copies = plan.copy_each or plan.nonfinite is not None
        if not (fast and copies and not plan.flag_apart and not plan.one_in_flight and not missing):
            self._warn_once("path", "overlap_optimizer_step: this backward is finished in full (a comm hook whose "
                            "collectives are not issued up front, sparse gradients, or a gradient with a graph)")
            return False
        # The first round is finished in full, so the bucket rebuild comes where torch's does.
        return not (reducer._observed_order is not None and not reducer.buckets_rebuilt)

    def after_collectives(self, buckets: Sequence[Bucket], params: Sequence[nn.Parameter], status: Status,
                          step: Backward) -> None:
        """The reducer waited for a round that ``defer`` declined: as the all-reduce's, then time it."""
        super().after_collectives(buckets, params, status, step)
        self._record_timing(time.perf_counter())

    def at_forward_start(self, full: bool) -> None:
        """A forward through the wrapper starts: the missing-gradient flag is read before this forward's own
        collectives (so a rank that raises issues the same collectives as one that raised at its backward);
        ``full``: something about to read every parameter or rebuild the buckets needs the round finished."""
        if self.round is not None:
            if full:
                self.finish()
            else:
                self._check_flag()

    def finish(self) -> None:
        """Wait for every bucket still in flight and apply the noted step and zero_grad: a full wait."""
        if self.round is not None:
            self._finish_buckets(range(len(self.reducer.buckets)))

    def finish_params(self, indices: Sequence[int]) -> None:
        """Finish the buckets that hold these parameters (indices into the reducer's); none in flight: returns."""
        if self.round is None:
            return
        location = self.reducer._location
        self._finish_buckets(sorted({location[i][0] for i in indices}, reverse=True))

    def _finish_buckets(self, indices: Sequence[int]) -> None:
        self._check_flag()
        for b in indices:
            r = self.round
            if r is None:
                return
            if not r.done[b]:
                self._finish_bucket(r, b)

    def _finish_bucket(self, r: _Round, b: int) -> None:
        reducer = self.reducer
        bucket = reducer.buckets[b]
        plan = r.step.plan
        order = r.step.order
        while not order.launched(b):  # a module that needs a bucket further on (its own order): up to it
            order.launch_next()
        r.waited_s += wait_bucket(bucket, b == len(reducer.buckets) - 1, plan.hooked, reducer.observer, True,
                                  plan.fused)
        order.launch_next()  # the wire is free: the next bucket of the sequence, one at a time
        r.done[b] = True
        r.left -= 1
        if self.step_hyperparams is not None:
            self._update(bucket.params)
        if r.left == 0:
            self._close(r)

    def _check_flag(self) -> None:
        """Wait for the last bucket (it carries the missing-gradient flag) and raise, on every rank alike, before
        any parameter is updated, if any rank missed a gradient."""
        r = self.round
        if r is None or r.flag_checked:
            return
        r.flag_checked = True
        last = len(self.reducer.buckets) - 1
        reducer = self.reducer
        bucket = reducer.buckets[last]
        plan = r.step.plan
        r.waited_s += wait_bucket(bucket, True, plan.hooked, reducer.observer, False, plan.fused)
        r.done[last] = True
        r.left -= 1
        self._record_timing(time.perf_counter())  # in index order the last launched: the wire's end
        try:
            if plan.nonfinite is not None:  # every bucket was checked before this one went (``check_ahead``)
                plan.nonfinite.after_wait(reducer.buckets, plan.hooked, plan.flag_apart)
            status = reducer.usage.exchange_status([], False, bucket, reducer.process_group)
            if status.any_missing:
                explain = None if reducer.module_changes is None else reducer.module_changes.explain
                raise_missing_gradients(status.missing, reducer.names, reducer.process_group, False, status.late,
                                        explain)
        except Exception:
            self._abandon(r)
            raise
        if bucket.direct is None and not bucket.plan.sparse:
            grads = cast("list[torch.Tensor]", bucket.grads)  # the fast path: every one set
            torch._foreach_copy_(grads, bucket.views)  # the verdict is in: the average into .grad
        if self.step_hyperparams is not None:
            self._update(bucket.params)
        if r.left == 0:
            self._close(r)

    def _abandon(self, r: _Round) -> None:
        """A round that raises: launch and wait for the rest (nothing left on the wire), apply nothing, close it."""
        while r.step.order.launch_next():
            pass
        for b, done in enumerate(r.done):
            if not done:
                r.waited_s += wait_bucket(self.reducer.buckets[b], False, r.step.plan.hooked, None, False,
                                          r.step.plan.fused)
        self.step_hyperparams = self.zero_set_to_none = None
        self._close(r)

    def _close(self, r: _Round) -> None:
        """Every bucket finished: the round's bookkeeping, as at the end of a plain backward."""
        self.round = None
        self.step_hyperparams = self.zero_set_to_none = None
        self.reducer.end_round(r.waited_s)

    # ----------------------------------------------------------------- the update of a subset
    def _update(self, params: Sequence[nn.Parameter]) -> None:
        """The noted step on ``params`` alone, with the hyperparameters it was noted with; then the noted zero_grad."""
        ids = {id(p) for p in params}
        noted = self.step_hyperparams
        assert noted is not None
        groups = self.optimizer.param_groups
        saved = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        try:
            for g, values in zip(groups, noted):
                g.update(values)
            self._call_on(lambda p: id(p) in ids, self._call_step)
        finally:
            for g, values in zip(groups, saved):
                g.update(values)
        if self.zero_set_to_none is not None:
            set_to_none = self.zero_set_to_none
            self._call_on(lambda p: id(p) in ids, lambda: self._zero_grad(set_to_none))

    def _update_foreign(self) -> None:
        """The optimizer's parameters that this DDP does not average (another model's, ignored ones) step now."""
        mine = {id(p) for p in self.reducer.params}
        if any(id(p) not in mine for g in self.optimizer.param_groups for p in g["params"]):
            self._call_on(lambda p: id(p) not in mine, self._call_step)

    def _call_on(self, keep: Callable[[torch.Tensor], bool], call: Callable[[], Any]) -> None:
        call_on(self.optimizer, keep, call)

    # ----------------------------------------------------------------- the launch sequence
    def _record_timing(self, done_s: float) -> None:
        reducer = self.reducer  # its first launch of the timed backward (``Reducer._launch``)
        self._timings.append((reducer.layout_version, reducer._first_launch_s, self._drain_s, done_s))
        del self._timings[:-MEASURED_ROUNDS]

    def _maybe_agree(self) -> tuple[Any, torch.Tensor] | None:
        """Issue, once, the all-reduce that agrees on how many buckets go in index order before the rest go last
        first: the minimum over ranks of each one's estimate. Every rank decides to issue it from the same facts
        (the layout's version, the rounds timed on it), so the collective sequence stays the same."""
        reducer = self.reducer
        version = reducer.layout_version
        if self.sequence_layout == version or not reducer.buckets_rebuilt:
            return None
        if reducer.tuner is not None and not reducer.tuner.done:
            return None
        timed = [t for t in self._timings if t[0] == version]
        if self.fixed_bytes is None and len(timed) < MEASURED_ROUNDS:
            return None
        estimate = torch.tensor([self._estimate(timed)], dtype=torch.int64)
        if dist.get_backend(reducer.process_group) == "nccl":
            estimate = estimate.to(reducer.buckets[0].buffer.device)
        work = dist.all_reduce(estimate, op=dist.ReduceOp.MIN, group=reducer.process_group, async_op=True)
        self.sequence_layout = version  # no second agreement on this layout
        return work, estimate

    def _read_agreement(self, agreed: tuple[Any, torch.Tensor]) -> None:
        """The agreed count: waited for at once (one small all-reduce, once per layout)."""
        work, estimate = agreed
        work.wait()
        self.sequence = priority_sequence(len(self.reducer.buckets), int(estimate.item()))

    def _estimate(self, timed: list[tuple[int, float, float, float]]) -> int:
        """Buckets the wire carries during backward: bytes/s from the plain-order rounds (first launch to the last
        average back) times the backward's sending time (first launch to its end), as a count of leading buckets."""
        sizes = [b.plan.numel * b.plan.dtype.itemsize for b in self.reducer.buckets]
        if self.fixed_bytes is not None:
            budget = float(self.fixed_bytes)
        else:
            rates, windows = [], []
            for _, first, drain, done in timed:
                rates.append(sum(sizes) / max(done - first, 1e-6))
                windows.append(drain - first)
            if min(done - drain for _, _, drain, done in timed) < 0.05 * max(windows):
                return len(sizes)  # the averages were back about when backward ended: the wire keeps up
            budget = min(rates) * min(windows)
        count, total = 0, 0
        for size in sizes:
            if total + size > budget:
                break
            total += size
            count += 1
        return max(count, 1)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)


def _snapshot(value: Any) -> Any:
    """A hyperparameter as it is now (a tensor learning rate is updated in place by schedulers)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


class OverlappedOptimizer(torch.optim.Optimizer):
    """What ``overlap_optimizer_step`` returns: the user's optimizer as the loop steps it, bound the one way every
    variant binds (``Reducer.bind``; ZeRO-2's ``zero_optimizer`` returns its own). ``step()`` notes the step (each
    bucket's parameters are stepped in the next forward as its average lands), ``zero_grad()`` is noted for the
    parameters still in flight; ``param_groups``, ``state`` and ``defaults`` are the user's optimizer's own objects,
    so an LR scheduler built on either reaches both. ``state_dict`` and ``load_state_dict`` finish the round first.
    No method is replaced on the user's optimizer; stepped directly while bound, it raises in one line (a step
    pre-hook): its gradients may still be on the wire."""

    def __init__(self, overlap: OverlappedStep):
        inner = overlap.optimizer
        self._overlap, self._inner, self._built = overlap, inner, False
        torch.optim.Optimizer.__init__(self, [p for g in inner.param_groups for p in g["params"]], inner.defaults)
        self.param_groups, self.state, self.defaults = inner.param_groups, inner.state, inner.defaults
        self._built = True

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer, bound."""
        return self._inner

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._overlap.note_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._overlap.note_zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self._overlap.finish()
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._overlap.finish()
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._built:  # torch.optim.Optimizer.__init__'s own call
            super().add_param_group(param_group)
            return
        self._inner.add_param_group(param_group)
