"""The reducer: turns per-parameter "gradient ready" events into bucketed, overlapped all-reduces.

One class, read in step order (docs/architecture.md has a step's call path): the bucket layout (``layout``); before
forward (finish a backward that could not, rebuild the buckets once, tune); backward start (the path decided once,
``step.plan_backward``, and a fresh ``step.Backward``); the per-gradient hook (``grad_hook.make_hook``; off its common
path ``on_grad``: the gradient into its slot, pre-divided, ``copy_in``); the launch, in bucket index order
(``launch_order``), because every rank must issue collectives in the same order; the end of backward
(``_finalize_backward``): every bucket launches anyway where a gradient is missing, with a flag in the last bucket's
spare element, so all ranks learn of it from a collective they issue regardless and all raise; then the collectives
shared with a joined rank's shadow (``schedule``) and the averages back into ``.grad`` (``copy_back``); the reset (the
backward's state dropped whole). What a reducer leaves behind: ``lifetime``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.ddp.autotune import BucketTuner
from lockstep.ddp.compiled import refuse_compiled_autograd
from lockstep.ddp.config import BucketCaps
from lockstep.ddp.copy_back import copy_back
from lockstep.ddp.copy_in import copy_in, empty_sparse_like, unalias_grads
from lockstep.ddp.dist_autograd import DistAutogradBridge
from lockstep.ddp.errors import error_for_log, twice_message
from lockstep.ddp.fused_compress import FusedCompression
from lockstep.ddp.grad_hook import make_hook
from lockstep.ddp.graph import backward_accumulates, grad_accumulators
from lockstep.ddp.idle_buckets import release_idle
from lockstep.ddp.launch_order import LaunchOrder
from lockstep.ddp.layout import agree_on_order, build_layout, move_grads_into
from lockstep.ddp.lifetime import register_for_exit, remove_handles
from lockstep.ddp.lifetime import release_works as release_reducer_works
from lockstep.ddp.observe import Observer
from lockstep.ddp.optim_in_backward import step_optimizers_in_backward
from lockstep.ddp.reducer_state import Bucket, UsageTracker
from lockstep.ddp.schedule import CommHook, finish_collectives, issue_bucket
from lockstep.ddp.step import (
    COPY,
    VIEW,
    Backward,
    fast_table,
    fused_now,
    grad_mode,
    one_in_flight,
    plan_backward,
)


class Reducer:
    """Bucketed gradient averaging for one replica's parameters.

    Args:
        params: parameters that require grad, each once (tied weights deduplicated).
        names: their qualified names, for error messages.
        process_group: the group to average over.
        caps: the bucket caps (``config.BucketCaps``: fixed, first, rebuilt first, auto, direct threshold).
        gradient_as_bucket_view: None: ``param.grad`` becomes its averaged bucket slot (no copy back);
            False: copies, as torch's default; True: torch's bucket views (``copy_in`` has the three).
        find_unused_parameters: find, after each forward, the parameters its graph does not reach.
        static_graph: learn unused parameters and hook counts in the first iteration, reuse them after.
        sparse: per parameter, whether its gradient is sparse (torch's ``expect_sparse_gradient``): a bucket
            of its own, all-reduced as a sparse tensor (``copy_in``); None: none is.
    """

    logged_error: str | None = None  # the last error DDP raised (a backward's, the wrapper's), for the logging data
    comm_hook_name: str | None = None  # torch's built-in hook types (``_register_builtin_comm_hook``), for logging

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        caps: BucketCaps,
        gradient_as_bucket_view: bool | None = False,  # None: .grad becomes the bucket slot (ddp/copy_in.py)
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        sparse: Sequence[bool] | None = None,
    ):
        self.params = list(params)
        self.names = list(names)
        self.sparse = [bool(s) for s in sparse] if sparse is not None else [False] * len(self.params)
        if len(self.sparse) != len(self.params):
            raise ValueError(f"sparse: {len(self.sparse)} flags for {len(self.params)} parameters")
        self.has_sparse = any(self.sparse)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.divisor = self.world_size  # ranks still training, under join(divide_by_initial_world_size=False)
        self.caps = caps
        # The layout's caps now: the auto-tuner's trials change the per-bucket caps, the rebuild the first one.
        self.bucket_cap_bytes = caps.cap_bytes
        self.first_bucket_bytes = caps.first_bytes
        self.bucket_caps_bytes: list[int] | None = caps.caps_bytes
        self.grad_mode = grad_mode(gradient_as_bucket_view)
        self.gradient_as_bucket_view = self.grad_mode == VIEW  # torch's True: the bucket is divided at launch
        self.usage = UsageTracker(len(self.params), find_unused_parameters, static_graph)
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.fused: FusedCompression | None = None  # the hook's average, run here instead (``fused_compress``)
        self.nonfinite: Any = None  # diagnostics.nonfinite.NonfiniteCheck (detect_nonfinite=True); None = off
        self.observer: Observer | None = None  # diagnostics (``observe``); None = off
        self.module_changes: Any = None  # ddp.module_changes.ModuleChanges: explains missing gradients; None = off
        self.events: list[tuple] | None = None  # tests: ("ready", i) / ("launch", b); None = off
        self.optimizers_in_backward = False  # torch's _apply_optimizer_in_backward on these parameters
        self.post_backward_futures: list = []  # a buffer comm hook's futures, waited for at the end of backward
        self.expect_hooks = False  # set by a synchronised forward: other backwards' hooks do nothing
        self.step: Backward | None = None  # the running backward's state, from its start to its end
        self._unused_at_start: list[int] = []  # what the last synchronised forward's graph did not reach
        self._observed_order: list[int] | None = []  # first synced backward's ready order, for the rebuild
        self.rebuild_pending = False
        self.buckets_rebuilt = False
        self.released_bytes = 0  # bucket memory given back at the last synchronised forward (``idle_buckets``)
        self.direct_launches = 0  # all-reduces on a gradient where autograd left it (``copy_in``), since construction
        self.launch_seq = 0  # launches issued since construction: the same on every rank, step after step
        self.comm_wait_s = 0.0
        self.num_syncs = 0
        self.rounds = 0  # synchronised backwards completed, a joined rank's shadows included: the same on every rank
        self.tuner = BucketTuner(caps.auto) if caps.auto is not None else None
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._accumulators = grad_accumulators(self.params)  # tells autograd.grad from backward (``graph``)
        self.dist_autograd = DistAutogradBridge(self)  # backwards whose gradients land in an RPC context
        self._fast_cache: tuple[tuple, list] | None = None  # (layout, divisor, hook) -> the hook's common-path table
        self.buckets: list[Bucket] = []
        self.layout_version = 0
        self._build(list(reversed(range(len(self.params)))))
        ref = weakref.ref(self)  # the parameters outlive a dropped DDP object; its reducer must not
        self._handles = [p.register_post_accumulate_grad_hook(make_hook(ref, i)) for i, p in enumerate(self.params)]
        weakref.finalize(self, remove_handles, self._handles)
        register_for_exit(self)

    # ------------------------------------------------------------- bucket layout
    def _build(self, order: list[int]) -> None:
        if self.buckets:
            self.release_works(keep=False)  # before the old buckets go
        direct = self.caps.direct_min_bytes if self.grad_mode == COPY else None
        layout = build_layout(self.params, order, self.bucket_cap_bytes, self.first_bucket_bytes,
                              self.bucket_caps_bytes, direct, self.sparse if self.has_sparse else None)
        self._param_order, self.buckets, self._location = layout.order, layout.buckets, layout.location
        self._sizes = layout.sizes
        self.layout_version += 1  # the fast table's cache key
        self.step = None
        if self.gradient_as_bucket_view:
            move_grads_into(self.buckets)

    def bucket_layout(self) -> list[list[int]]:
        """Parameter indices (into ``params``) of each bucket, in launch order."""
        return [list(b.plan.param_indices) for b in self.buckets]

    def rebuild_buckets(self) -> None:
        """Rebuild once from the first synced backward's ready order (rank 0's, so all ranks agree)."""
        self.rebuild_pending = False
        observed, self._observed_order = self._observed_order or [], None
        device = self.buckets[0].buffer.device if dist.get_backend(self.process_group) == "nccl" else "cpu"
        order, self.first_bucket_bytes = agree_on_order(observed, len(self.params), self.caps.rebuilt_first_bytes or 0,
                                                        self.process_group, device)
        self._build(order)
        self.buckets_rebuilt = True

    def relayout(self, bucket_caps_bytes: list[int]) -> None:
        """New buckets with these caps, in the current order (the auto-tuner's trials; every rank at the same round)."""
        self.bucket_caps_bytes = bucket_caps_bytes
        self._build(self._param_order)

    # ------------------------------------------------------------- before forward
    def between_steps(self) -> None:
        """Before a round's collectives, on every rank (a forward, or a joined rank's shadow): rebuild, tune."""
        if self.rebuild_pending:
            self.rebuild_buckets()
        if self.tuner is not None and not self.tuner.done:
            self.tuner.between_steps(self, hook_known=not one_in_flight(self.comm_hook, self._fused_now()))

    def prepare_for_forward(self) -> None:
        """Start of a synchronised forward: finish a backward that could not, rebuild buckets once."""
        step = self.step
        if step is not None:
            # The last backward stopped half-way (an exception inside it) with buckets never launched: launch them
            # now so the other ranks' waits complete, and raise here as they raise there (nothing if none was ready).
            self._finalize_backward()
        self.between_steps()
        # Bucket views: a bucket no .grad points into gives its memory back until its next gradient (``idle_buckets``).
        self.released_bytes = release_idle(self.buckets, self.grad_mode)

    def prepare_after_forward(self, outputs: Any) -> None:
        """After a synchronised forward: hooks count; note the parameters this backward will not reach.

        ``outputs=None``: not known (torch's ``prepare_for_backward([])`` from a library), so nothing is
        marked unused up front; with find_unused_parameters a parameter left without gradient is unused.
        """
        self.expect_hooks = True
        self.dist_autograd.at_forward(self._accumulators)
        # Ready only at backward start: a forward with no backward (eval, grad on) must not launch what peers never do.
        self._unused_at_start = [] if outputs is None else self.usage.unused_before_backward(outputs, self._index_of)

    # ------------------------------------------------------------- backward start
    def _fused_now(self) -> FusedCompression | None:  # read by the trace (``diagnostics.trace``) too
        return fused_now(self.fused, self.nonfinite, self.has_sparse)

    def _begin(self, common_path: bool) -> Backward:
        """A fresh backward and plan; ``common_path``: the hook's common path may apply (not a joined rank's shadow)."""
        fast = None
        if (common_path and self.expect_hooks and self.grad_mode == COPY and not self.usage.active
                and self._observed_order is None and self.events is None):  # the first backward records the order
            hooked = self.comm_hook is not None
            key = (self.layout_version, self.divisor, not hooked)
            if self._fast_cache is None or self._fast_cache[0] != key:
                self._fast_cache = (key, fast_table(self.buckets, len(self.params), self.divisor, hooked))
            fast = self._fast_cache[1]
        plan = plan_backward(mode=self.grad_mode, divisor=self.divisor, comm_hook=self.comm_hook, fused=self.fused,
                             nonfinite=self.nonfinite, has_sparse=self.has_sparse,
                             last_bucket_sparse=self.buckets[-1].plan.sparse, tracks_usage=self.usage.active, fast=fast)
        self.step = Backward(plan, list(self._sizes), LaunchOrder(self.buckets, self._launch, plan.one_in_flight))
        return self.step

    def on_backward_start(self, from_hook: bool = False) -> None:
        """The first node of backward ran (or the first hook fired): plan it, queue its end, mark the unused."""
        if self.step is not None:
            return
        refuse_compiled_autograd()  # its trace would run our hooks, not the real backward (``compiled``)
        # Runs once the whole backward is done: the only safe point to wait for the buckets.
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        self.release_works(keep=False)  # before this backward launches its own
        step = self._begin(common_path=True)
        if self.observer is not None:
            self.observer.backward_start()
        if self._unused_at_start and (from_hook or backward_accumulates(self._accumulators)):
            self._mark_unused(step)
        # Else this graph task runs no parameter's AccumulateGrad node (yet): a ``torch.autograd.grad`` through
        # the outputs (a gradient penalty, an adversarial attack), which must launch nothing, or a model wholly
        # behind reentrant checkpoints, whose nested backwards do: the first hook marks them (``on_grad``).

    def _mark_unused(self, step: Backward) -> None:
        unused, self._unused_at_start = self._unused_at_start, []
        step.marked_unused = unused
        for i in unused:
            self._mark_ready(step, i, self.params[i].grad)

    # ------------------------------------------------------------- per gradient (off the hook's common path)
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
        # A hook can fire with no gradient (an undefined gradient flowed back): not a use of the parameter.
        try:
            if self.usage.active and not self.usage.gradient_complete(index, self.names, grad is not None):
                return  # static graph: more pieces of this gradient are still to come
        except RuntimeError as error:  # static_graph's changed graph: in the logging data too, as torch's
            self.logged_error = error_for_log(error)
            raise
        if self._observed_order is not None:
            self._observed_order.append(index)
        self._mark_ready(step, index, grad, True)

    def is_ready(self, index: int) -> bool:  # parameter ``index`` is in its bucket in this backward
        b, slot = self._location[index]
        return self.buckets[b].seen[slot]

    def _mark_ready(self, step: Backward, index: int, grad: torch.Tensor | None, hooked: bool = False) -> None:
        b, slot = self._location[index]
        bucket = self.buckets[b]
        if bucket.seen[slot]:
            raise RuntimeError(twice_message(self.names[index], hooked and index in step.marked_unused))
        bucket.seen[slot] = True
        if self.events is not None:
            self.events.append(("ready", index))
        copy_in(step, self.params, self.names, index, bucket, slot, grad, hooked)
        step.pending[b] -= 1
        if step.pending[b] == 0:
            self.bucket_full(step, b)

    def bucket_full(self, step: Backward, b: int) -> None:
        if self.observer is not None:
            self.observer.bucket_ready(b)
        step.order.mark_ready(b)

    # ------------------------------------------------------------- launch (in index order: ``launch_order``)
    def _launch(self, bucket: Bucket) -> None:
        if self.events is not None:
            self.events.append(("launch", bucket.index))
        self.launch_seq += 1
        bucket.seq = self.launch_seq
        observer = self.observer
        if observer is not None:
            observer.bucket_launch(bucket.index, bucket.flat.numel(), bucket.seq)
        step = self.step
        assert step is not None
        self.direct_launches += bucket.direct is not None
        group, hook = self.process_group, self.comm_hook
        bucket.work = issue_bucket(bucket, step, len(self.buckets), group, hook, self.comm_hook_state)
        if observer is not None:
            observer.bucket_launched(bucket.index, bucket.seq)

    # ------------------------------------------------------------- end of backward
    def _finalize_backward(self) -> None:
        step = self.step
        if step is None:
            return
        if not step.hooks_fired and not any(any(b.seen) for b in self.buckets):
            # No parameter of this model got a gradient and nothing was launched: a torch.autograd.grad through
            # the outputs (a gradient penalty, an adversarial attack), a loss that did not depend on the model
            # (torch.func.functional_call with other tensors). Nothing to reduce, as in torch, and, as torch's
            # reducer, still expecting this forward's backward: R1's loss.backward() after its autograd.grad.
            self._end_step()
            return
        self.expect_hooks = False
        try:
            missing = self._mark_the_rest(step)
            fast = not (self.gradient_as_bucket_view or step.graph_grads or step.missing_flag or step.fixups)
            # torch's order, common path: each bucket copied back once its wait returns, overlapping those in flight.
            early = fast and step.plan.copy_each
            futures, self.post_backward_futures = self.post_backward_futures, []
            explain = None if self.module_changes is None else self.module_changes.explain
            status, waited = finish_collectives(step, self.buckets, self.usage, self.process_group, missing,
                                                joined=False, copy_each=early, observer=self.observer, futures=futures,
                                                names=self.names, explain=explain)
            self.comm_wait_s += waited
            if not early:
                copy_back(self.buckets, self.params, status.globally_used, self.grad_mode, fast)
            if self.optimizers_in_backward:
                step_optimizers_in_backward(self.params)
            self.num_syncs += 1
            self.rounds += 1
            if self.observer is not None:
                self.observer.backward_end(self.num_syncs)
            if self._observed_order is not None and not self.buckets_rebuilt:
                self.rebuild_pending = True
        except Exception as error:  # as torch's reducer, noted for the wrapper's logging data
            self.logged_error = error_for_log(error)
            raise
        finally:
            self.dist_autograd.at_end_of_backward(self.params)  # under distributed autograd: averages into the context
            self._end_step()

    def _mark_the_rest(self, step: Backward) -> list[int]:
        """Mark every parameter still without a gradient, so every bucket launches (the other ranks wait in them);
        return the missing ones the flag is about (none with find_unused_parameters: those are unused)."""
        if self.usage.in_static_first_iteration():
            # Static graph, iteration 1: nothing was launched during backward; now every count is known.
            order = self.usage.finish_static_first_iteration()
            if self._observed_order is not None:
                self._observed_order = order
            for i in order + self.usage.static_unused:
                if not self.is_ready(i):  # find_unused_parameters marked the unused ones already
                    self._mark_ready(step, i, self.params[i].grad)
        missing = [i for b in self.buckets for i, s in zip(b.plan.param_indices, b.seen) if not s]
        # With find_unused_parameters, a parameter reachable from the outputs that got no gradient (an
        # output the loss did not use, an undefined gradient) is unused this time, as in torch, not an
        # error: it contributes zeros and its .grad stays as it was where no rank used it.
        step.missing_flag = bool(missing) and not self.usage.find_unused
        for i in missing:
            self._mark_ready(step, i, self.params[i].grad)
        return missing if step.missing_flag else []

    def shadow_backward(self) -> None:
        """A joined rank's stand-in for one backward (``join``): the same collectives, in the same order, with zeros."""
        self.release_works(keep=False)  # as at a real backward's start
        unalias_grads(self.buckets, self.grad_mode)
        step = self._begin(common_path=False)
        for bucket in self.buckets:
            bucket.buffer.zero_()
            if bucket.plan.sparse:
                bucket.sparse = empty_sparse_like(bucket.params[0])  # nothing of its own: adds nothing to the sum
        try:
            finish_collectives(step, self.buckets, self.usage, self.process_group, [], joined=True, copy_each=False,
                               observer=None, futures=(), names=self.names, explain=None)
        finally:
            self._end_step()
        self.rounds += 1
        # As after a real backward: the training ranks rebuild their buckets at their next forward (a
        # broadcast), so a rank that joined before its own first backward must rebuild alongside them.
        if self._observed_order is not None and not self.buckets_rebuilt:
            self.rebuild_pending = True

    def _end_step(self) -> None:  # the backward's state goes whole; the buckets let go of its gradients
        self.step = None
        if self.nonfinite is not None:
            self.nonfinite.reset()
        for bucket in self.buckets:
            bucket.reset()
        self.usage.reset_backward()

    # ------------------------------------------------------------- hooks and works
    def remove_hooks(self) -> None:
        remove_handles(self._handles)
        self.dist_autograd.remove()

    def release_works(self, keep: bool = True) -> None:
        """Let go of the last backward's works: ``keep`` (at exit) hands them to the graveyard; otherwise (the
        start of every backward, a rebuild) they are dropped, as torch's DDP drops its own (``lifetime``)."""
        release_reducer_works(self.__dict__, keep)

    def __del__(self, _release: Any = release_reducer_works) -> None:  # bound here: module globals may be gone at exit
        # A dropped DDP object, or finalisation's collection: its works must not be freed here (``lifetime``).
        _release(self.__dict__, keep=True, clear=False)
