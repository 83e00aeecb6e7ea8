"""The reducer: turns per-parameter "gradient ready" events into bucketed, overlapped all-reduces.

One class read in step order (docs/architecture.md has a step's call path): the bucket layout; before forward; backward
start (the path decided once, ``step.plan_backward``); per gradient (the hook, ``make_hook`` after the class; off its
common path ``on_grad``); the launch, in bucket index order, as every rank must issue collectives in the same order; the
end of backward (``_finalize_backward``), whose collectives ``schedule`` issues, shared with a joined rank's shadow.
Where a gradient is missing every bucket launches anyway, with a flag in the last bucket's spare element: all raise.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from lockstep.collectives.hierarchical import HierarchicalAllReduce
from lockstep.ddp.args import sparse_flags
from lockstep.ddp.autotune import BucketTuner, LinkVerdict, all_say_slow, tail_wants_trials, trials_for_slow_wire
from lockstep.ddp.compiled import COMPILED_AUTOGRAD, COMPILED_REGION, refuse_compiled_autograd
from lockstep.ddp.config import BucketCaps
from lockstep.ddp.copy_in import copy_in, zero_for_shadow
from lockstep.ddp.dist_autograd import DistAutogradBridge, rpc_agent_set
from lockstep.ddp.errors import error_for_log, raise_missing_gradients, twice_message
from lockstep.ddp.fused_compress import FusedCompression
from lockstep.ddp.graph import backward_accumulates, grad_accumulators
from lockstep.ddp.idle_buckets import IdleBuckets
from lockstep.ddp.launch_order import SERIAL_MIN_BYTES, wire_is_slow
from lockstep.ddp.layout import agree_on_order, build_layout
from lockstep.ddp.lifetime import register_for_exit, remove_handles
from lockstep.ddp.lifetime import release_works as release_reducer_works
from lockstep.ddp.module_changes import ModuleChanges
from lockstep.ddp.observe import Observer, attach, detach
from lockstep.ddp.optim_in_backward import step_optimizers_in_backward, take_over_optimizers_in_backward
from lockstep.ddp.reducer_state import Bucket, Status, UsageTracker
from lockstep.ddp.step import (
    COPY,
    VIEW,
    Backward,
    FastCache,
    StepPlan,
    cached_fast_table,
    fused_now,
    grad_mode,
    nothing_to_reduce,
    one_in_flight,
    plan_backward,
)
from lockstep.ddp.strategy import AllReduce, CommHook
from lockstep.diagnostics.nonfinite import NonfiniteCheck

LINK_JUDGED_ROUND = 1  # rounds completed before the backward whose tail judges the wire: the one after the rebuild


class Reducer:
    """Bucketed gradient averaging for one replica's parameters (DDP's arguments, resolved by the wrapper)."""

    logged_error: str | None = None  # the last error DDP raised (a backward's, the wrapper's), for the logging data
    comm_hook_name: str | None = None  # torch's built-in hook types (``_register_builtin_comm_hook``), for logging
    hierarchy: HierarchicalAllReduce | None = None  # the plain buckets' all-reduce across nodes; None: flat

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],  # that require grad, each once (tied weights deduplicated)
        names: Sequence[str],  # their qualified names, for error messages
        process_group: dist.ProcessGroup,  # the group to average over
        caps: BucketCaps,  # fixed, first, rebuilt first, auto, direct threshold (``config``)
        gradient_as_bucket_view: bool | None = False,  # False: copies; True: views; None: .grad is its slot (copy_in)
        find_unused_parameters: bool = False,  # find, after each forward, the parameters its graph does not reach
        static_graph: bool = False,  # learn unused parameters and hook counts in iteration 1, reuse them after
        sparse: Sequence[bool] | None = None,  # per parameter, torch's expect_sparse_gradient (``copy_in``); None: none
        release_idle_buckets: bool | None = None,  # bucket views: free idle buckets between steps (``idle_buckets``)
    ):
        self.params, self.names = list(params), list(names)
        self.sparse = sparse_flags(sparse, len(self.params))
        self.has_sparse = any(self.sparse)
        self.process_group, self.world_size = process_group, dist.get_world_size(process_group)
        self.divisor = self.world_size  # ranks still training, under join(divide_by_initial_world_size=False)
        self.caps = caps
        # The layout's caps now: the auto-tuner's trials change the per-bucket caps, the rebuild the first one.
        self.bucket_cap_bytes = caps.cap_bytes
        self.first_bucket_bytes = caps.first_bytes
        self.bucket_caps_bytes: list[int] | None = caps.caps_bytes
        self.grad_mode = grad_mode(gradient_as_bucket_view)
        self.gradient_as_bucket_view = self.grad_mode == VIEW  # torch's True: the bucket is divided at launch
        self.usage = UsageTracker(len(self.params), find_unused_parameters, static_graph)
        self.comm_hook: CommHook | None = None  # and its state (``comm_hook_state``): ``set_comm_hook``
        self.comm_hook_state: object = None
        self.fused: FusedCompression | None = None  # the hook's average, run here instead (``fused_compress``)
        self.nonfinite: NonfiniteCheck | None = None  # detect_nonfinite=True (``diagnose``); None = off
        self.observer: Observer | None = None  # diagnostics (``observe``); None = off
        self.module_changes: ModuleChanges | None = None  # explains missing gradients; None = off
        self.events: list[tuple] | None = None  # tests: ("ready", i) / ("launch", b); None = off
        self.optimizers_in_backward = False  # torch's _apply_optimizer_in_backward on these parameters
        self.strategy = AllReduce().set_collectives(process_group, None, None, None)  # each point of the step: bind
        self.post_backward_futures: list = []  # a buffer comm hook's futures, waited for at the end of backward
        self.expect_hooks = False  # set by a synchronised forward: other backwards' hooks do nothing
        self.step: Backward | None = None  # the running backward's state, from its start to its end
        self._unused_at_start: list[int] = []  # what the last synchronised forward's graph did not reach
        self._observed_order: list[int] | None = []  # first synced backward's ready order, for the rebuild
        self.rebuild_pending = self.buckets_rebuilt = False  # once, from the first synced backward's order
        self.direct_launches = 0  # all-reduces on a gradient where autograd left it (``copy_in``), since construction
        self.launch_seq = 0  # launches issued since construction: the same on every rank, step after step
        self.serial_launch = False  # one at a time (``launch_order``), per rank: when, never which or in what order
        self._first_launch_s = self._backward_start_s = 0.0  # this backward's first launch, first node (perf_counter)
        self.link = LinkVerdict(pending=caps.link_aware and caps.auto is None and self.world_size > 1)  # autotune
        self.comm_wait_s, self.num_syncs = 0.0, 0
        self.rounds = 0  # synchronised backwards completed, a joined rank's shadows included: the same on every rank
        self.tuner = BucketTuner(caps.auto) if caps.auto is not None else None
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._accumulators = grad_accumulators(self.params)  # tells autograd.grad from backward (``graph``)
        self.dist_autograd = DistAutogradBridge(self)  # backwards whose gradients land in an RPC context
        self._fast_cache: FastCache | None = None  # (layout, divisor, hook) -> the hook's common-path table
        self._plan, self._plan_key = cast(StepPlan | None, None), cast(tuple, ())  # the last plan, its inputs (_begin)
        self.idle = IdleBuckets(release_idle_buckets if self.grad_mode != COPY else False)  # bucket views only
        self.buckets: list[Bucket] = []
        self.layout_version = 0  # the fast table's cache key, bumped by each layout build
        self._build(list(reversed(range(len(self.params)))))
        ref = weakref.ref(self)  # the parameters outlive a dropped DDP object; its reducer must not
        self._handles = [p.register_post_accumulate_grad_hook(make_hook(ref, i)) for i, p in enumerate(self.params)]
        register_for_exit(self, self._handles)  # the hooks go with the reducer, the works at exit

    # ------------------------------------------------------------- bucket layout
    def _build(self, order: list[int]) -> None:
        if self.buckets:
            self.release_works(keep=False)  # before the old buckets go
        layout = build_layout(self.params, order, self.bucket_cap_bytes, self.first_bucket_bytes,  # VIEW: grads in
                              self.bucket_caps_bytes, self.caps.direct_min_bytes, self.grad_mode, self.sparse,
                              shards=self.world_size if self.strategy.shards_buckets else 0)
        self._param_order, self.buckets, self._location = layout.order, layout.buckets, layout.location
        self._sizes = layout.sizes
        self._layout_bytes = sum(b.plan.numel * b.plan.dtype.itemsize for b in self.buckets)
        self.layout_version += 1  # the fast table's cache key
        self.step = None

    def bucket_layout(self) -> list[list[int]]:  # parameter indices (into ``params``) of each bucket, in launch order
        return [list(b.plan.param_indices) for b in self.buckets]

    def rebuild_buckets(self) -> None:  # once, from the first synced backward's ready order (rank 0's: all agree)
        self.rebuild_pending = False
        observed, self._observed_order = self._observed_order or [], None
        order, self.first_bucket_bytes = agree_on_order(observed, len(self.params), self.caps.rebuilt_first_bytes or 0,
                                                        self.process_group, self.buckets[0].buffer.device)
        self._build(order)
        self.buckets_rebuilt = True

    def relayout(self, bucket_caps_bytes: list[int]) -> None:  # new caps, the same order: the auto-tuner's trials
        self.bucket_caps_bytes = bucket_caps_bytes
        self._build(self._param_order)

    # ------------------------------------------------------------- collaborators (set between steps, here only)
    # The wrapper, its diagnostics and the Trainer's fault points set the reducer's collaborators through these
    # methods; no other module assigns to a reducer's attributes (tests/test_layout.py checks it).
    def attach_observer(self, observer: Observer) -> None:
        """Add ``observer`` to the ones told of each step's phases (``observe.attach``)."""
        self.observer = attach(self.observer, observer)

    def detach_observer(self, observer: Observer) -> None:
        self.observer = detach(self.observer, observer)

    def set_nonfinite(self, check: NonfiniteCheck | None) -> None:  # detect_nonfinite=True (``diagnose``); None: off
        self.nonfinite = check

    def set_module_changes(self, changes: ModuleChanges | None) -> None:  # explains missing gradients
        self.module_changes = changes

    def set_hierarchy(self, hierarchy: HierarchicalAllReduce | None) -> None:  # the plain buckets' all-reduce
        self.hierarchy = hierarchy
        self.strategy.set_collectives(self.process_group, self.comm_hook, self.comm_hook_state, hierarchy)

    def set_comm_hook(self, hook: CommHook, state: object, fused: FusedCompression | None) -> None:
        """``register_comm_hook``'s hook (the wrapper checked it); ``fused``: its average, run here instead."""
        self.strategy.take_hook(hook, fused)
        self.comm_hook, self.comm_hook_state, self.fused = hook, state, fused
        self.strategy.set_collectives(self.process_group, hook, state, self.hierarchy)

    def name_comm_hook(self, name: str) -> None:  # torch's built-in hook types, logged by type (``torch_surface``)
        self.comm_hook_name = name

    def use_static_graph(self) -> None:  # torch's _set_static_graph, before the first forward (``torch_surface``)
        self.usage = UsageTracker(len(self.params), self.usage.find_unused, True)

    def log_error(self, error: BaseException) -> None:  # an error DDP raised, for the logging data
        self.logged_error = error_for_log(error)

    def take_over_optimizers_in_backward(self) -> None:  # torch's _apply_optimizer_in_backward, at the first forward
        self.optimizers_in_backward = take_over_optimizers_in_backward(self.params)

    def bind(self, strategy: AllReduce, what: str) -> None:
        """The one way a strategy (and the optimizer it steps) binds to this reducer: once, between steps. ``what``:
        the caller's name for the error. A strategy that keeps its layout (ZeRO-2: padded, no direct bucket) gets the
        buckets built again now and kept for good (a rebuild from the observed order would leave its shards behind)."""
        self.check_unbound(what)
        self.strategy = strategy
        strategy.take_hook(self.comm_hook, self.fused)
        strategy.set_collectives(self.process_group, self.comm_hook, self.comm_hook_state, self.hierarchy)
        self.link.pending = False  # no tail to judge, nor the default's trials (``autotune``)
        if strategy.keeps_layout:
            self.rebuild_pending, self._observed_order, self.buckets_rebuilt = False, None, True
            self._build(self._param_order)
            strategy.take_layout(self.buckets, self._location, self.names)

    def check_unbound(self, what: str) -> None:
        """``bind``'s refusals, each one line naming ``what``; the wrapper asks before it builds a strategy."""
        if type(self.strategy) is not AllReduce:
            raise RuntimeError(f"{what}: a strategy is bound already ({self.strategy.name}; one of zero_optimizer, "
                               "overlap_optimizer_step and reduce_in per DistributedDataParallel)")
        if self.step is not None:
            raise RuntimeError(f"{what}: called inside a backward; bind it between steps")

    def limit_caps(self, cap_bytes: int) -> None:
        """Cap every bucket, and the rebuilt first one, at ``cap_bytes`` (applies at the next layout build)."""
        self.bucket_cap_bytes = min(self.bucket_cap_bytes, cap_bytes)
        first = min(self.caps.rebuilt_first_bytes or cap_bytes, cap_bytes)
        self.caps = dataclasses.replace(self.caps, rebuilt_first_bytes=first)

    # ------------------------------------------------------------- before forward
    def between_steps(self) -> None:
        """Before a round's collectives, on every rank (a forward, or a joined rank's shadow): rebuild, tune."""
        if self.rebuild_pending:
            self.rebuild_buckets()
        if self.tuner is not None and not self.tuner.done:
            self.tuner.between_steps(self, hook_known=not one_in_flight(self.comm_hook, self._fused_now()))

    def before_forward(self, full: bool = False, divisor: int | None = None) -> None:
        """A forward through the wrapper starts, on every rank before any other collective of its iteration.
        ``full``: the caller reads every parameter; ``divisor``: a synchronised forward's denominator (the world size,
        or the ranks still training under ``join(divide_by_initial_world_size=False)``); None: not synchronised.

        The strategy finishes what it holds in flight where this forward reads every parameter or re-lays the
        buckets; a backward that stopped half-way is finished; the one-time rebuild and the tuner's switches run
        (in a forward with grad, ``no_sync`` too, as torch's)."""
        relayout = self.rebuild_pending or (self.tuner is not None and not self.tuner.done)
        self.strategy.at_forward_start(full or relayout)
        if divisor is None:
            if relayout and torch.is_grad_enabled():
                self.between_steps()
            return
        self.divisor = divisor
        if self.step is not None:
            # The last backward stopped half-way (an exception in it), buckets unlaunched: launch them now so the
            # other ranks' waits complete, and raise here as they raise there (nothing if none was ready).
            self._finalize_backward()
        if self.rebuild_pending or (self.tuner is not None and not self.tuner.done):
            self.between_steps()
        if self.idle.release is not False and self.idle.wanted(self.buckets):  # bucket views (``idle_buckets``)
            self.release_works(keep=False)  # the last backward's, all complete; they hold the buffers
            self.idle.at_forward_start(self.buckets)  # a bucket no .grad points into goes until its next gradient

    def after_forward(self, outputs: object) -> None:
        """After a synchronised forward: hooks count; note the parameters this backward will not reach. Under RPC's
        distributed autograd, its context (``dist_autograd``): a C call per forward where RPC is not running."""
        self.expect_hooks = True
        if self.dist_autograd.context_id is not None or rpc_agent_set():
            self.dist_autograd.at_forward(self._accumulators)
        # Ready only at backward start: a forward with no backward (eval, grad on) must not launch what peers never do.
        self._unused_at_start = self.usage.unused_before_backward(outputs, self._index_of) if self.usage.active else []

    # ------------------------------------------------------------- backward start
    def _fused_now(self) -> FusedCompression | None:  # read by the trace (``diagnostics.trace``) too
        return fused_now(self.fused, self.nonfinite, self.has_sparse)

    def _begin(self, common_path: bool) -> Backward:
        """A fresh backward; ``common_path``: the hook's common path may apply (not a joined rank's shadow). Its plan
        is made again only where what it depends on changed (the layout, the divisor, the hook, the checks, the
        strategy, the first backward's recording): a steady step reuses it (a tuple comparison)."""
        # Not in the first backward (it records the order) nor where the strategy forbids it (``common_path``)
        fast_ok = (common_path and self.expect_hooks and self.grad_mode == COPY and not self.usage.active
                   and self._observed_order is None and self.events is None and self.strategy.common_path)
        key = (self.layout_version, self.divisor, self.comm_hook, self.fused, self.nonfinite, self.usage,
               self.strategy, fast_ok)
        plan = self._plan
        if plan is None or key != self._plan_key:
            self._plan, self._plan_key = plan, _ = self._make_plan(fast_ok), key
        sequence, stop = self.strategy.backward_start(self.layout_version)  # stop: the rest go from the next forward
        observer = self.observer  # a training rank's backward (a joined rank's shadow is silent)
        if common_path and observer is not None and observer.all_events:  # the watchdog's progress reads it
            observer.backward_start()
        serial = self.serial_launch and not self.strategy.defers  # a deferred round's drain must not wait
        order = LaunchOrder(self.buckets, self._launch, plan.one_in_flight or serial, sequence,
                            plan.nonfinite is not None, stop)
        self.step = Backward(plan, list(self._sizes), order)
        return self.step

    def _make_plan(self, fast_ok: bool) -> StepPlan:
        fast = None
        if fast_ok:
            self._fast_cache = cached_fast_table(self._fast_cache, self.layout_version, self.buckets, len(self.params),
                                                 self.divisor, hooked=self.comm_hook is not None)
            fast = self._fast_cache[1]
        return plan_backward(mode=self.grad_mode, divisor=self.divisor, comm_hook=self.comm_hook, fused=self.fused,
                             nonfinite=self.nonfinite, has_sparse=self.has_sparse,
                             last_bucket_sparse=self.buckets[-1].plan.sparse, tracks_usage=self.usage.active, fast=fast,
                             strategy=self.strategy)

    def on_backward_start(self, grad_outputs: object = None, from_hook: bool = False) -> None:
        """The first node of backward ran (the pre-hook on the outputs' ``grad_fn``, ``graph.on_backward_start``,
        which passes ``grad_outputs``), or the first hook fired: plan it, queue its end, mark the unused."""
        if self.step is not None:
            return
        compiled_autograd = sys.modules.get(COMPILED_AUTOGRAD)  # loaded with dynamo; its flag, a module attribute
        if compiled_autograd is not None and (getattr(compiled_autograd, COMPILED_REGION, True)
                                              or torch.compiler.is_compiling()):
            refuse_compiled_autograd()  # its trace would run our hooks, not the real backward (``compiled``)
        self._backward_start_s = time.perf_counter()
        # Runs once the whole backward is done: the only safe point to wait for the buckets.
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        for bucket in self.buckets:  # the last backward's works, all complete, before this one launches its own
            bucket.work = None
        if self.nonfinite is not None:  # and the NaN check's
            self.release_works(keep=False)
        if self.idle.release is not False:
            self.idle.at_backward_start()
        step = self._begin(common_path=True)  # the strategy finishes what is still in flight first (``backward_start``)
        if self._unused_at_start and (from_hook or backward_accumulates(self._accumulators)):
            self._mark_unused(step)
        # Else this graph task runs no parameter's AccumulateGrad node (yet): a torch.autograd.grad through the outputs
        # (must launch nothing), or a model wholly behind reentrant checkpoints: the first hook marks them (on_grad).

    def _mark_unused(self, step: Backward) -> None:
        unused, self._unused_at_start = self._unused_at_start, []
        step.marked_unused = unused
        for i in unused:
            self._mark_ready(step, i, self.params[i].grad)

    # ------------------------------------------------------------- per gradient (the hook: ``make_hook``; else here)
    def on_grad(self, index: int, param: torch.Tensor) -> None:
        """Parameter ``index``'s gradient is in ``param.grad`` (its hook, or a distributed-autograd node)."""
        step = self.step
        if step is None:  # usually started already by the outputs' grad_fn pre-hook
            self.on_backward_start(from_hook=True)
            step = self.step
            assert step is not None
        elif self._unused_at_start:
            self._mark_unused(step)  # left by on_backward_start: no AccumulateGrad node was to run in its graph task
        step.hooks_fired = True
        grad = param.grad  # read once: a property into C++, per parameter per step
        try:  # a hook can fire with no gradient (an undefined one flowed back): not a use of the parameter
            if self.usage.active and not self.usage.gradient_complete(index, self.names, grad is not None):
                return  # static graph: more pieces of this gradient are still to come
        except RuntimeError as error:  # static_graph's changed graph: in the logging data too, as torch's
            self.logged_error = error_for_log(error)
            raise
        if self._observed_order is not None:
            self._observed_order.append(index)
        self._mark_ready(step, index, grad, True)

    def is_ready(self, index: int) -> bool:  # parameter ``index`` is in its bucket in this backward
        return self.buckets[self._location[index][0]].seen[self._location[index][1]]

    def _mark_ready(self, step: Backward, index: int, grad: torch.Tensor | None, hooked: bool = False) -> None:
        b, slot = self._location[index]
        bucket = self.buckets[b]
        if bucket.seen[slot]:
            raise RuntimeError(twice_message(self.names[index], hooked and index in step.marked_unused))
        bucket.seen[slot] = True
        if self.events is not None:
            self.events.append(("ready", index))
        copy_in(step, self.params, self.names, index, bucket, slot, grad, hooked)
        self.strategy.copied(self.params[index], bucket, slot)
        step.pending[b] -= 1
        if step.pending[b] == 0:
            self.bucket_full(step, b)

    def bucket_full(self, step: Backward, b: int) -> None:
        observer = self.observer
        if observer is not None and observer.all_events:  # the tracer's; the watchdog's progress reads the buckets
            observer.bucket_ready(b)
        step.order.mark_ready(b)

    # ------------------------------------------------------------- launch (in index order: ``launch_order``)
    def _launch(self, bucket: Bucket) -> None:
        if self.events is not None:
            self.events.append(("launch", bucket.index))
        self.launch_seq += 1
        bucket.seq = self.launch_seq
        observer = self.observer
        if observer is not None and not observer.all_events:
            observer = None
        if observer is not None:
            observer.bucket_launch(bucket.index, bucket.flat.numel(), bucket.seq)
        step = self.step if self.step is not None else self.strategy.held_backward()  # from the next forward
        assert step is not None
        if step.order.next_index == 0:
            self._first_launch_s = time.perf_counter()  # the link's serial test, the overlapped step's timing
        nonfinite = step.plan.nonfinite  # the carrier of the verdict goes first: the held ones checked now
        if nonfinite is not None and step.order.carrier_last_ready and bucket.index == len(self.buckets) - 1:
            unlaunched = step.order.sequence[step.order.next_index + 1:]  # all ready (``LaunchOrder``)
            nonfinite.check_ahead([self.buckets[b] for b in unlaunched], step.plan.divisor, step.plan.hooked)
        self.direct_launches += bucket.direct is not None
        bucket.work = self.strategy.issue(bucket, step, bucket.index == len(self.buckets) - 1)
        if observer is not None:
            observer.bucket_launched(bucket.index, bucket.seq)

    # ------------------------------------------------------------- end of backward
    def _finalize_backward(self) -> None:
        step = self.step
        if step is None:
            return
        if not step.hooks_fired and nothing_to_reduce(step, self.buckets):  # an autograd.grad: nothing, as torch
            self._end_step()
            return
        self.expect_hooks = False
        deferred = False
        try:
            missing = self._mark_the_rest(step)
            deferred = self.strategy.defers and self.strategy.defer(step, missing)  # in flight to the next forward
            if deferred:
                if self.observer is not None:  # the backward ends here; its waits come in the next forward
                    self.observer.backward_end(self.num_syncs + 1)
                return
            judged = self.link.pending and self._judges_the_link()
            if judged:  # the tail: from the backward's end to its last average back (a slow wire's serial drain too)
                ended_s = time.perf_counter()
                backward_s, self.link.tail_bytes = ended_s - self._backward_start_s, step.order.bytes_to_cross()
            futures, self.post_backward_futures = self.post_backward_futures, []
            explain = None if self.module_changes is None else self.module_changes.explain
            status, waited = finish_collectives(step, self.buckets, self.usage, self.process_group, missing,
                                                joined=False, copy_each=True, observer=self.observer, futures=futures,
                                                names=self.names, explain=explain)
            # After the waits: one bucket at a time from the next backward on where the wire is slow
            elapsed_s = time.perf_counter() - self._first_launch_s
            self.serial_launch = self._layout_bytes >= SERIAL_MIN_BYTES and wire_is_slow(self._layout_bytes, elapsed_s,
                                                                                         waited)
            if judged:
                self.link.tail_s = tail_s = time.perf_counter() - ended_s
                self.link.vote = tail_wants_trials(self.link.tail_bytes, tail_s, backward_s)
                self._agree_on_the_link()
            self.strategy.after_collectives(self.buckets, self.params, status, step)
            self.end_round(waited, reset=False)
        except Exception as error:  # as torch's reducer, noted for the wrapper's logging data
            self.logged_error = error_for_log(error)
            self.strategy.on_error()
            raise
        finally:
            if self.dist_autograd.saved is not None:  # under distributed autograd: averages into the context
                self.dist_autograd.at_end_of_backward(self.params)
            if deferred:
                self.step = None  # the buckets keep this backward's gradients until its round closes (``overlap``)
            else:
                self._end_step()
        if self.observer is not None:  # the step's last event, once the buckets let go of its gradients
            self.observer.backward_end(self.num_syncs)

    def _judges_the_link(self) -> bool:
        """This backward's tail decides whether the default caps go to trials: the synchronised one after the
        rebuild (gloo's buffers for these sizes exist by then; the first backward pays for them). A joined rank's
        shadow of it takes part in the agreement (``shadow_backward``)."""
        return self.link.pending and self.rounds == LINK_JUDGED_ROUND and self.buckets_rebuilt

    def _agree_on_the_link(self) -> None:
        """The judged backward's end, on every rank (a joined rank's shadow votes "not slow"): the verdicts agreed,
        one all-reduce after the backward's other collectives, once per run; trials from the next round."""
        self.link.pending = False
        if all_say_slow(self.link.vote, self.process_group, self.buckets[0].buffer.device) and self.tuner is None:
            self.tuner = trials_for_slow_wire(self.link.tail_bytes, self.link.tail_s,
                                              dist.get_rank(self.process_group))

    def end_round(self, waited_s: float, reset: bool = True) -> None:
        """A synchronised backward's averages are in ``.grad``: its bookkeeping (``reset``: a deferred round's close;
        the end of backward resets the buckets itself, then tells the observer)."""
        self.comm_wait_s += waited_s
        if self.optimizers_in_backward:
            step_optimizers_in_backward(self.params)
        self.num_syncs += 1
        self.rounds += 1
        if self._observed_order is not None and not self.buckets_rebuilt:
            self.rebuild_pending = True
        if reset:
            self._end_step()

    def _mark_the_rest(self, step: Backward) -> list[int]:
        """Mark every parameter still without a gradient, so every bucket launches (the other ranks wait in them);
        return the missing ones the flag is about (none with find_unused_parameters: those are unused)."""
        if self.usage.active and self.usage.in_static_first_iteration():  # nothing launched in it; counts known now
            order = self.usage.finish_static_first_iteration()
            if self._observed_order is not None:
                self._observed_order = order
            for i in order + self.usage.static_unused:
                if not self.is_ready(i):  # find_unused_parameters marked the unused ones already
                    self._mark_ready(step, i, self.params[i].grad)
        missing = [i for b in self.buckets for i, seen in zip(b.plan.param_indices, b.seen) if not seen]
        step.missing_flag = bool(missing) and not self.usage.find_unused  # find_unused: unused this time, not an error
        for i in missing:
            self._mark_ready(step, i, self.params[i].grad)
        return missing if step.missing_flag else []

    def shadow_backward(self) -> None:
        """A joined rank's stand-in for one backward (``join``): the same collectives, in the same order, with zeros."""
        self.release_works(keep=False)  # as at a real backward's start
        zero_for_shadow(self.buckets, self.grad_mode)  # nothing of its own: adds nothing to the sum
        self.strategy.before_shadow()  # as the training ranks' zero_grad
        step = self._begin(common_path=False)
        try:
            status, _ = finish_collectives(step, self.buckets, self.usage, self.process_group, [], joined=True,
                                           copy_each=False, observer=None, futures=(), names=self.names, explain=None)
            if self._judges_the_link():  # the training ranks' agreement on the wire; this rank votes "not slow"
                self._agree_on_the_link()
        finally:
            self._end_step()
        self.strategy.after_shadow(status)  # as the training ranks' opt.step()
        self.rounds += 1
        # As after a real backward: the training ranks rebuild at their next forward (a broadcast), so must this one.
        if self._observed_order is not None and not self.buckets_rebuilt:
            self.rebuild_pending = True

    def _end_step(self) -> None:  # the backward's state goes whole; the buckets let go of its gradients
        self.step = None
        if self.nonfinite is not None:
            self.nonfinite.reset()
        for bucket in self.buckets:
            bucket.reset()
        if self.usage.active:
            self.usage.reset_backward()

    # ------------------------------------------------------------- hooks and works
    def remove_hooks(self) -> None:
        remove_handles(self._handles)
        self.dist_autograd.remove()

    def release_works(self, keep: bool = True) -> None:  # the last works: to the graveyard (``keep``) or dropped
        release_reducer_works(self.__dict__, keep)

    def __del__(self, _release: Callable[..., None] = release_reducer_works) -> None:
        # A dropped DDP object, or finalisation's: works not freed here (``lifetime``); bound: globals may be gone.
        _release(self.__dict__, keep=True, clear=False)


# ----------------------------------------------------------------- the launch order, the same on every rank
# Gradients become ready in an order that can differ between ranks (threads, timing), but collectives must be issued
# in the same order everywhere or they pair up wrongly and hang: a bucket ready before an earlier one waits for it,
# and the end of backward drains whatever is still held back. Part of the skeleton (a steady step's every launch
# passes here), so it lives with it; the sequences and the slow-link rule are ``launch_order``'s.
def _done(work: object) -> bool:
    """A bucket's collective has finished: a ``dist.Work`` (``is_completed``) or a comm hook's Future (``done``)."""
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else bool(work.done())  # type: ignore[attr-defined]


class LaunchOrder:
    """When a ready bucket may launch (``launch_order`` has the sequences and the slow-link rule): launches ``buckets``
    through ``launch`` in ``sequence`` (default: index order) as they become ready; one per backward.

    ``one_in_flight``: a hook that may issue collectives from its callbacks is registered (the backward's plan), or
    the link is slow (``SERIAL_BELOW_BYTES_S``): each bucket launches once the previous one is done.
    """

    __slots__ = ("_launch", "_one_in_flight", "carrier_last_ready", "buckets", "next_index", "ready", "sequence",
                 "stop")

    def __init__(self, buckets: Sequence[Bucket], launch: Callable[[Bucket], None], one_in_flight: bool,
                 sequence: Sequence[int] | None = None, carrier_last_ready: bool = False, stop: int | None = None):
        self.buckets = buckets
        self._launch = launch
        self._one_in_flight = one_in_flight
        # The last bucket (its spare element carries the non-finite verdict) waits until every bucket is ready, so
        # all can be checked before it goes (``overlap_step``'s sequence launches it ahead of others).
        self.carrier_last_ready = carrier_last_ready and sequence is not None
        self.sequence = range(len(buckets)) if sequence is None else sequence
        self.ready = [False] * len(buckets)
        self.next_index = 0  # position in ``sequence`` of the next bucket to launch
        # Positions from here on wait for ``launch_next`` (the overlapped step feeds the wire from the next forward,
        # one bucket at a time, so gloo's two threads do not share the link between the first layers' bucket and
        # the next); by default none wait.
        self.stop = len(buckets) if stop is None else stop

    def mark_ready(self, index: int) -> None:
        """Bucket ``index`` holds all its gradients: launch it, and any later ones it was holding back."""
        self.ready[index] = True
        buckets, sequence, n = self.buckets, self.sequence, len(self.buckets)
        while self.next_index < min(n, self.stop) and self.ready[sequence[self.next_index]]:
            if self.next_index > 0 and self._one_in_flight and not _done(buckets[sequence[self.next_index - 1]].work):
                break  # the previous hooked bucket is still in flight: drain() or a later ready bucket retries
            if self.carrier_last_ready and sequence[self.next_index] == n - 1 and not all(self.ready):
                break  # the verdict's carrier goes once every bucket can be checked: a later ready one or drain()
            self._launch(buckets[sequence[self.next_index]])
            self.next_index += 1

    def drain(self) -> None:
        """End of backward: launch every bucket still held back, each hooked one after the previous is done."""
        sequence = self.sequence
        while self.next_index < min(len(self.buckets), self.stop):
            if self.next_index > 0 and self._one_in_flight:
                self.buckets[sequence[self.next_index - 1]].work.wait()
            self._launch(self.buckets[sequence[self.next_index]])
            self.next_index += 1

    def launch_next(self) -> bool:
        """Launch the next bucket held at ``stop`` (every one is ready: after drain()); False if none is left."""
        if self.next_index >= len(self.buckets):
            return False
        self.stop = max(self.stop, self.next_index + 1)
        self._launch(self.buckets[self.sequence[self.next_index]])
        self.next_index += 1
        return True

    def bytes_to_cross(self) -> int:
        """Bytes of the buckets not launched yet or not complete: what the end of backward still waits for."""
        launched = set(self.sequence[: self.next_index])
        return sum(b.plan.numel * b.plan.dtype.itemsize for b in self.buckets
                   if b.index not in launched or not _done(b.work))

    def launched(self, index: int) -> bool:
        """Bucket ``index`` has been launched this backward."""
        return index in self.sequence[: self.next_index]


# ----------------------------------------------------------------- the end of backward's collectives, written once
# A training rank (``Reducer._finalize_backward``) and a joined rank standing in for one backward
# (``Reducer.shadow_backward``, under ``join``) must issue the same collectives in the same order, or they pair up
# wrongly and hang. So both call ``finish_collectives``: the buckets still held back launch (in index order); the
# status exchange, where this backward needs one, is launched right behind them so it hides behind their waits; the
# waits (the strategy's); the non-finite agreement; the status read; and, where any rank missed a gradient, the
# gather that names them. What differs between the two callers is only data (a joined rank's buckets hold zeros, it
# has no gradient missing and used none), never a collective. ``tests/test_schedule.py`` records both ranks'
# collectives in every mode and compares them.
def finish_collectives(
    step: Backward,
    buckets: Sequence[Bucket],
    usage: UsageTracker,
    group: dist.ProcessGroup,
    missing: list[int],
    *,
    joined: bool,
    copy_each: bool,
    observer: Observer | None,
    futures: Sequence[torch.futures.Future],
    names: Sequence[str],
    explain: Callable[[list[int]], str] | None,
) -> tuple[Status, float]:
    """Issue and finish the rest of this backward's collectives; return the agreed status and the seconds waited.

    ``missing``: the parameters this rank marked without a gradient (the flag is already in ``step``);
    ``joined``: a joined rank's shadow (zeros, nothing used). ``copy_each``: each bucket's averages go into
    its gradients right after its wait (``AllReduce.wait``). ``futures``: a buffer comm hook's, waited
    for after the buckets. Raises the missing-gradient error on every rank alike, the joined one included.
    """
    plan = step.plan
    step.order.drain()  # every bucket launched, in index order; a hooked one after the previous is done
    # Every collective of this backward is now issued unless a hook issues some from its callbacks: the status
    # exchange (comm hook, find_unused_parameters) queues behind them and hides behind their waits.
    launched = None
    if not plan.one_in_flight and (usage.active or plan.flag_apart):  # else the flag travels in the last bucket
        launched = usage.launch_status(missing, plan.flag_apart, buckets[-1], group, joined)
    if observer is not None:  # the watchdog's progress reads which one from the works
        observer.waiting(buckets, plan.strategy.waits_on)
        if not observer.all_events:
            observer = None  # the per-bucket waits: for observers that take every event (``observe``)
    waited = plan.strategy.wait(buckets, step, observer, copy_each)  # the reduction's (``strategy``)
    if futures:
        start = time.perf_counter()
        for future in futures:
            future.wait()
        waited += time.perf_counter() - start
    if plan.nonfinite is not None:
        # raises on every rank alike; ZeRO-2 checked the local gradients before the reduce-scatters, as a hook's
        plan.nonfinite.after_wait(buckets, plan.checks_local, plan.flag_apart)
    status = usage.exchange_status(missing, plan.flag_apart, buckets[-1], group, joined, launched)
    if status.any_missing:
        raise_missing_gradients(status.missing, names, group, usage.static_graph, status.late, explain)
    return status, waited


# ----------------------------------------------------------------- the per-parameter hook
def make_hook(reducer_ref: Callable[[], Reducer | None], index: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``index``'s post-accumulate-grad hook; holds the reducer weakly (parameters outlive a dropped DDP).

    Per parameter per backward, in Python (torch's is C++): where the plan has a common-path table (``step.fast_table``)
    it does a subset of ``on_grad``'s steps, in order: mark the slot, one fused scale-and-copy, count down the bucket.
    Anything else (no gradient, a second one, one with a graph or sparse, a direct or sparse bucket) goes through
    ``on_grad``. Why, and what it saves: docs/architecture.md. The hot path: no attribute lookup or call to spare.
    """

    def hook(param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is None:
            return
        step = reducer.step
        if step is not None:
            plan = step.plan
            fast = plan.fast
            if fast is not None:
                entry = fast[index]
                grad = param.grad
                if entry is not None and grad is not None and not grad.requires_grad and not grad.is_sparse:
                    bucket, slot, view, scale = entry
                    if bucket.storage_freed:  # ZeRO-2 freed it after its last reduce-scatter: memory back, same views
                        bucket.make_resident()
                    seen = bucket.seen
                    if not seen[slot]:  # a second gradient is an error: the slow path raises it
                        step.hooks_fired = True
                        seen[slot] = True
                        if scale is None:
                            view.copy_(grad)
                        else:
                            torch.mul(grad, scale, out=view)
                        if plan.drops_grads:
                            param.grad = None  # in the bucket now (ZeRO-2)
                        else:
                            bucket.grads[slot] = grad  # copy_back's target, and the non-finite check's input
                        pending = step.pending
                        left = pending[bucket.index] - 1
                        pending[bucket.index] = left
                        if not left:
                            reducer.bucket_full(step, bucket.index)
                        return
        if reducer.expect_hooks:
            reducer.on_grad(index, param)
        elif reducer.usage.track_window:
            reducer.usage.used_in_window[index] = True  # no_sync micro-batch: synchronise this one later

    return hook
