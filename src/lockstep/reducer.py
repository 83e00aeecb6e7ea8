"""The reducer: turns per-parameter "gradient ready" events into bucketed, overlapped all-reduces.

One post-accumulate-grad hook per parameter copies the gradient into its bucket's
flat buffer (pre-divided by the world size, fused into the copy); when a bucket's
last gradient lands, its all-reduce is launched asynchronously, but only in bucket
index order, because every rank must issue collectives in the same order. The end
of backward (an autograd engine callback) waits for the buckets and copies the
averaged values back into ``param.grad`` (one ``_foreach_copy_`` per bucket), or
leaves them in place when ``param.grad`` is a view of the bucket.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lockstep.buckets import BucketPlan, assign_buckets
from lockstep.grad_bucket import GradBucket

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class _Bucket:
    """Runtime state of one bucket: the flat buffer, a view per parameter, the in-flight collective."""

    __slots__ = ("index", "plan", "buffer", "views", "params", "grads", "work")

    def __init__(self, index: int, plan: BucketPlan, params: Sequence[torch.nn.Parameter]):
        self.index = index
        self.plan = plan
        self.params = [params[i] for i in plan.param_indices]
        self.buffer = torch.zeros(plan.numel, dtype=plan.dtype, device=plan.device)
        self.views = [
            self.buffer[offset : offset + p.numel()].view(p.shape) for offset, p in zip(plan.offsets, self.params)
        ]
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.work: Any = None  # dist.Work (default all-reduce) or a Future (comm hook)


class Reducer:
    """Bucketed gradient averaging for one replica's parameters.

    Args:
        params: parameters that require grad, each once (tied weights deduplicated).
        names: their qualified names, for error messages.
        process_group: the group to average over.
        bucket_cap_bytes / first_bucket_bytes: bucket caps (see ``assign_buckets``).
        gradient_as_bucket_view: make ``param.grad`` a view into the bucket buffer (no copy back).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        bucket_cap_bytes: int,
        first_bucket_bytes: int,
        gradient_as_bucket_view: bool = False,
        bucket_caps_bytes: Sequence[int] | None = None,
    ):
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_bytes = bucket_cap_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.bucket_caps_bytes = bucket_caps_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        # Per-backward state.
        self.expect_hooks = False  # set by prepare_for_backward: hooks outside a synced forward do nothing
        self._callback_queued = False
        self._seen = [False] * len(self.params)
        self._next_launch = 0
        # Ready order of the first synced backward; buckets are rebuilt from it once.
        self._observed_order: list[int] | None = []
        self.rebuild_pending = False
        self.buckets_rebuilt = False
        # Diagnostics: event log (None = off, costs one branch per hook) and comm wait time.
        self.events: list[tuple] | None = None
        self.comm_wait_s = 0.0
        self.num_syncs = 0
        self._build(list(reversed(range(len(self.params)))))
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ----------------------------------------------------------------- layout
    def _build(self, order: list[int]) -> None:
        plans = assign_buckets(self.params, order, self.bucket_cap_bytes, self.first_bucket_bytes, self.bucket_caps_bytes)
        self.buckets = [_Bucket(b, plan, self.params) for b, plan in enumerate(plans)]
        self._bucket_of = [0] * len(self.params)
        self._slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.plan.param_indices):
                self._bucket_of[i] = bucket.index
                self._slot_of[i] = slot
        self._sizes = [len(b.params) for b in self.buckets]
        self._pending = list(self._sizes)
        self._ready = [False] * len(self.buckets)
        if self.gradient_as_bucket_view:
            # Existing gradients move into the new buffers so no accumulated value is lost.
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view

    def bucket_layout(self) -> list[list[int]]:
        """Parameter indices (into ``params``) of each bucket, in launch order."""
        return [list(b.plan.param_indices) for b in self.buckets]

    def rebuild_buckets(self) -> None:
        """Rebuild once from the first synced backward's ready order (rank 0's, so all ranks agree).

        Costs one broadcast of ``len(params)`` integers, once per run.
        """
        self.rebuild_pending = False
        observed = self._observed_order or []
        self._observed_order = None
        # Parameters that never became ready go last, in reverse registration order.
        seen = set(observed)
        order = observed + [i for i in reversed(range(len(self.params))) if i not in seen]
        device = self.buckets[0].buffer.device if dist.get_backend(self.process_group) == "nccl" else "cpu"
        order_t = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(order_t, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        self._build(order_t.tolist())
        self.buckets_rebuilt = True

    # ------------------------------------------------------------- backward
    def prepare_for_backward(self) -> None:
        """Called by a forward that will be synchronised: the coming backward's hooks count."""
        if self.rebuild_pending:
            self.rebuild_buckets()
        self.expect_hooks = True

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.expect_hooks:
                self._mark_ready(index, param)

        return hook

    def _mark_ready(self, index: int, param: torch.Tensor) -> None:
        if self._seen[index]:
            raise RuntimeError(
                f"parameter {self.names[index]!r} received its gradient twice in one backward. This happens "
                "with activation checkpointing (torch.utils.checkpoint) or a module used twice in one forward: "
                "pass static_graph=True to DistributedDataParallel."
            )
        self._seen[index] = True
        if not self._callback_queued:
            # Runs once the whole backward is done: the only safe point to wait for the buckets.
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            self._callback_queued = True
        if self._observed_order is not None:
            self._observed_order.append(index)
        if self.events is not None:
            self.events.append(("ready", index))
        b = self._bucket_of[index]
        bucket = self.buckets[b]
        slot = self._slot_of[index]
        view = bucket.views[slot]
        grad = param.grad
        if self.gradient_as_bucket_view:
            if grad.data_ptr() != view.data_ptr():
                # The grad was allocated fresh (first step, or zero_grad(set_to_none=True)): one copy, then alias.
                view.copy_(grad)
                param.grad = view
        elif self.comm_hook is None:
            torch.div(grad, self.world_size, out=view)  # the average's division, fused into the copy
        else:
            view.copy_(grad)  # a comm hook gets the plain sum's inputs, as in torch
        bucket.grads[slot] = grad
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._ready[b] = True
            # Launch in index order only: a later bucket that is ready first waits for the earlier ones.
            while self._next_launch < len(self.buckets) and self._ready[self._next_launch]:
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self.events is not None:
            self.events.append(("launch", bucket.index))
        if self.comm_hook is not None:
            bucket.work = self.comm_hook(self.comm_hook_state, GradBucket(bucket, len(self.buckets)))
            if not isinstance(bucket.work, torch.futures.Future):
                raise TypeError(
                    f"comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} must return a "
                    f"torch.futures.Future, got {type(bucket.work).__name__}"
                )
            return
        if self.gradient_as_bucket_view:
            bucket.buffer.div_(self.world_size)  # one pass per bucket instead of one call per parameter
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)

    def _unready_names(self) -> list[str]:
        return [self.names[i] for i, seen in enumerate(self._seen) if not seen]

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        self.expect_hooks = False
        try:
            if self._next_launch < len(self.buckets):
                names = self._unready_names()
                rank = dist.get_rank()
                raise RuntimeError(
                    f"rank {rank}: {len(names)} parameter(s) received no gradient in this backward: "
                    f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''}. DistributedDataParallel needs "
                    "every parameter to take part in the loss on every rank: pass find_unused_parameters=True, "
                    "or static_graph=True if the same parameters are unused every iteration."
                )
            start = time.perf_counter()
            for bucket in self.buckets:
                result = bucket.work.wait()
                if self.comm_hook is not None:
                    tensor = result[0] if isinstance(result, (list, tuple)) else result
                    if tensor.data_ptr() != bucket.buffer.data_ptr():
                        bucket.buffer.copy_(tensor.view(-1))
            self.comm_wait_s += time.perf_counter() - start
            if not self.gradient_as_bucket_view:
                for bucket in self.buckets:
                    torch._foreach_copy_(bucket.grads, bucket.views)
            self.num_syncs += 1
            if self._observed_order is not None and not self.buckets_rebuilt:
                self.rebuild_pending = True
        finally:
            self._reset()

    def _reset(self) -> None:
        self._seen = [False] * len(self.params)
        self._pending = list(self._sizes)
        self._ready = [False] * len(self.buckets)
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.work = None
            bucket.grads = [None] * len(bucket.params)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
