"""The reducer: turns per-parameter "gradient ready" events into bucketed, overlapped all-reduces.

One post-accumulate-grad hook per parameter copies the gradient into its bucket's
flat buffer (pre-divided by the world size, fused into the copy: ``copy_in``; the common case is done in
the hook itself, ``grad_hook``); when a bucket's last gradient lands, its all-reduce is launched
asynchronously, but only in bucket index order (``launch_order``), because every rank must issue
collectives in the same order. The end of backward waits for the buckets and, by default
(``gradient_as_bucket_view=False``, torch's), copies the averages back into the local gradients (one
``_foreach_copy_`` per bucket, right after its wait on the common path: ``copy_back``); with
None (opt-in) or True the hook has made ``param.grad`` its bucket slot, so nothing is copied back. A
large parameter's bucket is direct (``copy_in``): its all-reduce runs on ``param.grad`` itself.

Parameters that get no gradient are the classic DDP hang: their bucket never
launches on one rank while the others wait. Here the end of backward (or, on a rank
whose backward could not finish, its next forward) launches every bucket anyway,
with a flag in one spare element of the last bucket, so all ranks learn of the
problem from a collective they were issuing regardless, and all raise.

What a reducer leaves behind (works, hooks) and when it goes: ``lifetime``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lockstep.collectives.clean import all_reduce_sum_clean, launch_clean
from lockstep.ddp.autotune import AutoBucketCap, BucketTuner
from lockstep.ddp.compiled import refuse_compiled_autograd
from lockstep.ddp.copy_in import VIEW, GradIntake, grad_mode
from lockstep.ddp.dist_autograd import DistAutogradBridge
from lockstep.ddp.end_of_backward import EndOfBackward
from lockstep.ddp.fused_compress import FusedCompression, HookPaths
from lockstep.ddp.grad_bucket import GradBucket
from lockstep.ddp.graph import backward_accumulates, grad_accumulators
from lockstep.ddp.grad_hook import fast_table, make_hook
from lockstep.ddp.layout import Layout
from lockstep.ddp.lifetime import register_for_exit, remove_handles
from lockstep.ddp.lifetime import release_works as release_reducer_works
from lockstep.ddp.observe import StepObserver
from lockstep.ddp.errors import twice_message
from lockstep.ddp.reducer_state import Bucket, UsageTracker
from lockstep.ddp.torch_surface import ReducerSurface, error_for_log

# Where one all-reduce's fixed cost (~0.5 ms at 2 ranks on gloo) is below what the copies in and out
# of a bucket cost a gradient this large (~0.15 ms per MB each way, measured on the 10.5M MLP).
DEFAULT_DIRECT_MIN_BYTES = 4 * 1024 * 1024

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class Reducer(Layout, EndOfBackward, GradIntake, HookPaths, ReducerSurface):
    """Bucketed gradient averaging for one replica's parameters.

    Args:
        params: parameters that require grad, each once (tied weights deduplicated).
        names: their qualified names, for error messages.
        process_group: the group to average over.
        bucket_cap_bytes / first_bucket_bytes / bucket_caps_bytes: bucket caps (see ``assign_buckets``).
        rebuilt_first_bucket_bytes: this rank's first-bucket cap for the rebuilt layout (None: keep
            ``first_bucket_bytes``); rank 0's is used on every rank (``rebuild_buckets``).
        gradient_as_bucket_view: None: ``param.grad`` becomes its averaged bucket slot (no copy back);
            False: copies, as torch's default; True: torch's bucket views (``copy_in`` has the three).
        find_unused_parameters: find, after each forward, the parameters its graph does not reach.
        static_graph: learn unused parameters and hook counts in the first iteration, reuse them after.
        auto_buckets: try these caps over the first steps and keep the fastest (``autotune``); None: fixed caps.
        direct_min_bytes: a parameter this large (CPU, copies mode) is all-reduced in its own gradient,
            no copy in or out (``copy_in``); None: never.
        sparse: per parameter, whether its gradient is sparse (torch's ``expect_sparse_gradient``): a bucket
            of its own, all-reduced as a sparse tensor (``copy_in``); None: none is.
    """

    logged_error: str | None = None  # the last error DDP raised (a backward's, the wrapper's), for the logging data

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        bucket_cap_bytes: int,
        first_bucket_bytes: int,
        gradient_as_bucket_view: bool | None = False,  # None: .grad becomes the bucket slot (ddp/copy_in.py)
        bucket_caps_bytes: Sequence[int] | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        auto_buckets: AutoBucketCap | None = None,
        direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES,
        rebuilt_first_bucket_bytes: int | None = None,
        sparse: Sequence[bool] | None = None,
    ):
        self.params = list(params)
        self.sparse = [bool(s) for s in sparse] if sparse is not None else [False] * len(self.params)
        if len(self.sparse) != len(self.params):
            raise ValueError(f"sparse: {len(self.sparse)} flags for {len(self.params)} parameters")
        self.has_sparse = any(self.sparse)
        self.buckets: list[Bucket] = []
        self.direct_min_bytes = direct_min_bytes
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.divisor = self.world_size  # the number of ranks still training, under join(divide_by_initial_world_size=False)
        self.bucket_cap_bytes = bucket_cap_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.rebuilt_first_bucket_bytes = first_bucket_bytes if rebuilt_first_bucket_bytes is None else rebuilt_first_bucket_bytes
        self.bucket_caps_bytes = bucket_caps_bytes
        self.grad_mode = grad_mode(gradient_as_bucket_view)
        self.gradient_as_bucket_view = self.grad_mode == VIEW  # torch's True: the bucket is divided at launch
        self.usage = UsageTracker(len(self.params), find_unused_parameters, static_graph)
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.fused: FusedCompression | None = None  # the hook's average, run here instead (``fused_compress``)
        self.expect_hooks = False  # set by a synchronised forward: other backwards' hooks do nothing
        self._callback_queued = False
        self._unused_at_start: list[int] = []
        self._marked_unused: list[int] = []  # what the last backward started by marking unused (read by an error only)
        self._hooks_fired = False
        self._observed_order: list[int] | None = []  # first synced backward's ready order, for the rebuild
        self.rebuild_pending = False
        self.buckets_rebuilt = False
        self.events: list[tuple] | None = None  # tests: ("ready", i) / ("launch", b); None = off
        self.observer: StepObserver | None = None  # diagnostics (``observe``); None = off
        self.optimizers_in_backward = False  # torch's _apply_optimizer_in_backward on these parameters
        self.post_backward_futures: list = []  # a buffer comm hook's futures, waited for at the end of backward
        self.module_changes: Any = None  # ddp.module_changes.ModuleChanges: explains missing gradients; None = off
        self.nonfinite: Any = None  # diagnostics.nonfinite.NonfiniteCheck (detect_nonfinite=True); None = off
        self.direct_launches = 0  # all-reduces run on a gradient where autograd left it (``copy_in``), since construction
        self.launch_seq = 0  # launches issued since construction: the same on every rank, step after step
        self.comm_wait_s = 0.0
        self.num_syncs = 0
        self.rounds = 0  # synchronised backwards completed, a joined rank's shadows included: the same on every rank
        self.tuner = BucketTuner(auto_buckets) if auto_buckets is not None else None
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._accumulators = grad_accumulators(self.params)  # tells autograd.grad from backward (``graph``)
        self.dist_autograd = DistAutogradBridge(self)  # backwards whose gradients land in an RPC context
        self._fast: list | None = None  # this backward's common-path table (``grad_hook``); None: every hook goes slow
        self._fast_cache: tuple | None = None
        self.layout_version = 0
        self._build(list(reversed(range(len(self.params)))))
        self_ref = weakref.ref(self)  # the parameters outlive a dropped DDP object; its reducer must not
        self._handles = [p.register_post_accumulate_grad_hook(make_hook(self_ref, i)) for i, p in enumerate(self.params)]
        weakref.finalize(self, remove_handles, self._handles)
        register_for_exit(self)

    def between_steps(self) -> None:
        """Before a round's collectives, on every rank (a forward, or a joined rank's shadow): rebuild, tune."""
        if self.rebuild_pending:
            self.rebuild_buckets()
        if self.tuner is not None and not self.tuner.done:
            self.tuner.between_steps(self, hook_known=not self._hook_one_in_flight())

    # ------------------------------------------------------------- forward
    def prepare_for_forward(self) -> None:
        """Start of a synchronised forward: finish a backward that could not, rebuild buckets once."""
        if self._hooks_fired or any(any(b.seen) for b in self.buckets):
            # The last backward stopped half-way (an exception inside it) with buckets never launched:
            # launch them now so the other ranks' waits complete, and raise here as they raise there.
            self._finalize_backward()
        elif self._callback_queued:
            self._callback_queued = False  # a backward aborted before any gradient: nothing to finish
        self.between_steps()

    def prepare_after_forward(self, outputs: Any) -> None:
        """After a synchronised forward: hooks count; note the parameters this backward will not reach.

        ``outputs=None``: not known (torch's ``prepare_for_backward([])`` from a library), so nothing is
        marked unused up front; with find_unused_parameters a parameter left without gradient is unused.
        """
        self.expect_hooks = True
        self.dist_autograd.at_forward(self)
        # Marked ready only once backward starts: a forward with no backward (a validation pass
        # with grad enabled) must not launch a bucket that the other ranks may never launch.
        self._unused_at_start = [] if outputs is None else self.usage.unused_before_backward(outputs, self._index_of)

    def on_backward_start(self) -> None:
        """The first node of backward ran (or the first hook fired): queue the end, mark the unused."""
        if self._callback_queued:
            return
        refuse_compiled_autograd()  # its trace would run our hooks, not the real backward (``compiled``)
        # Runs once the whole backward is done: the only safe point to wait for the buckets.
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        self._callback_queued = True
        self.release_works(keep=False)  # before this backward launches its own
        self._fast = fast_table(self)
        if self.observer is not None:
            self.observer.backward_start()
        if self._unused_at_start and (self._hooks_fired or backward_accumulates(self._accumulators)):
            self._mark_unused()
        # Else this graph task runs no parameter's AccumulateGrad node (yet): a ``torch.autograd.grad`` through
        # the outputs (a gradient penalty, an adversarial attack), which must launch nothing, or a model wholly
        # behind reentrant checkpoints, whose nested backwards do: the first hook marks them (``_on_grad``).

    def _mark_unused(self) -> None:
        unused, self._unused_at_start = self._unused_at_start, []
        self._marked_unused = unused
        for i in unused:
            self._mark_ready(i, self.params[i].grad)

    # ------------------------------------------------------------- backward
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        self._hooks_fired = True
        if not self._callback_queued:  # usually queued already by the outputs' grad_fn pre-hook
            self.on_backward_start()
        elif self._unused_at_start:
            self._mark_unused()  # left by on_backward_start: no AccumulateGrad node was to run in its graph task
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
        self._mark_ready(index, grad, True)

    def _mark_ready(self, index: int, grad: torch.Tensor | None, hooked: bool = False) -> None:
        b, slot = self._location[index]
        bucket = self.buckets[b]
        if bucket.seen[slot]:
            raise RuntimeError(twice_message(self.names[index], hooked and index in self._marked_unused))
        bucket.seen[slot] = True
        if self.events is not None:
            self.events.append(("ready", index))
        self._copy_in(index, bucket, slot, grad, hooked)  # ``copy_in``: by gradient_as_bucket_view's mode
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._bucket_full(b)

    def _bucket_full(self, b: int) -> None:
        if self.observer is not None:
            self.observer.bucket_ready(b)
        self._order.mark_ready(b)

    def _launch(self, bucket: Bucket) -> None:
        if self.events is not None:
            self.events.append(("launch", bucket.index))
        self.launch_seq += 1
        bucket.seq = self.launch_seq
        observer = self.observer
        if observer is not None:
            observer.bucket_launch(bucket.index, bucket.flat.numel(), bucket.seq)
        self._issue(bucket)
        if observer is not None:
            observer.bucket_launched(bucket.index, bucket.seq)

    def _issue(self, bucket: Bucket) -> None:  # the NaN check first, where it must see the local gradients
        divided = self.nonfinite is not None and self.nonfinite.check_bucket(bucket, self.divisor, self.comm_hook is not None)
        last = bucket.index == len(self.buckets) - 1
        self.direct_launches += bucket.direct is not None
        if last:  # the spare element: every rank's flag is summed there (where no hook is called: ``_flag_apart``)
            bucket.buffer[-1] = float(self._missing_flag)
        fused = self._fused_now()
        if fused is not None:
            bucket.work = fused.launch(bucket, last, self.process_group)
            return
        if self.comm_hook is not None:
            bucket.work = launch_clean(self.comm_hook, self.comm_hook_state, GradBucket(bucket, len(self.buckets)))
            if not isinstance(bucket.work, torch._C.Future):  # torch.futures.Future and the C++ futures of get_future()
                raise TypeError(
                    f"comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} must return a "
                    f"torch.futures.Future, got {type(bucket.work).__name__}"
                )
            return
        if bucket.plan.sparse:  # divided already (``copy_in``); the flag travels apart when this is the last (``_flag_apart``)
            bucket.work = all_reduce_sum_clean(bucket.sparse, self.process_group)
            return
        if self.gradient_as_bucket_view and self.divisor != 1 and not divided:
            bucket.flat.div_(self.divisor)  # one pass per bucket instead of one call per parameter
        if bucket.direct is not None:  # the gradient itself (``copy_in``; never the last bucket)
            tensor = bucket.direct
        elif last:
            tensor = bucket.buffer  # with its spare element, and the non-finite count scaled apart from the flag
            if self.nonfinite is not None:
                self.nonfinite.add_flag(bucket.buffer)
        else:
            tensor = bucket.flat  # the gradients only, as a direct bucket sends on a rank that went direct
        bucket.work = all_reduce_sum_clean(tensor, self.process_group)

    def remove_hooks(self) -> None:
        remove_handles(self._handles)
        self.dist_autograd.remove()

    def release_works(self, keep: bool = True) -> None:
        """Let go of the last backward's works: ``keep`` (at exit) hands them to the graveyard; otherwise (the
        start of every backward, a rebuild) they are dropped, as torch's DDP drops its own (``lifetime``)."""
        release_reducer_works(self.__dict__, keep)

    def __del__(self, _release=release_reducer_works) -> None:  # bound here: module globals may be gone at exit
        # A dropped DDP object, or finalisation's collection: its works must not be freed here (``lifetime``).
        _release(self.__dict__, keep=True, clear=False)

