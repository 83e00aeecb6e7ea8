"""The reduction strategy: what a reducer's one step skeleton does at each of its points.

``Reducer`` runs the same skeleton for every variant (before forward, backward start, per gradient, a bucket full, its
launch, the end of backward, a joined rank's shadow of one, the next forward's start) and hands each point to the one
strategy object bound to it. ``AllReduce`` is the default and DDP's: every bucket all-reduced, its average copied back
into ``.grad`` at the end of backward. The others subclass it and change the points they need:

* ``zero2.ZeroShards`` (``ddp.zero_optimizer(..., stage=2)``): each bucket reduce-scattered into this rank's shard,
  the bucket's memory freed as soon as its shard holds the average; nothing copied back.
* ``overlap_step.OverlappedStep`` (``ddp.overlap_optimizer_step(opt)``): the tail of the buckets held back to the next
  forward, each module's parameters stepped as its bucket lands.

A strategy binds once, between steps (``Reducer.bind``), and holds its own state; the reducer keeps no field of any
strategy and has no branch on which one is bound. Hooks (fp16/bf16 compression, PowerSGD), the non-finite check and
the observers are the reducer's, orthogonal to the strategy: they apply under every one that accepts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lockstep.collectives.clean import all_reduce_sum_clean, launch_clean
from lockstep.collectives.hierarchical import HierarchicalAllReduce
from lockstep.ddp.copy_back import copy_back
from lockstep.ddp.grad_bucket import GradBucket
from lockstep.ddp.reducer_state import Bucket, Status
from lockstep.ddp.step import VIEW

if TYPE_CHECKING:
    from lockstep.ddp.fused_compress import FusedCompression
    from lockstep.ddp.observe import Observer
    from lockstep.ddp.step import Backward, StepPlan

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class AllReduce:
    """DDP's reduction: every bucket all-reduced (or given to the comm hook), averages back into ``.grad``.

    Holds the collectives' settings the reducer gives it (``set_collectives``): the group, the comm hook and its
    state, the hierarchy; the reducer keeps them too (torch's surface reads them there)."""

    name = "all-reduce"
    waits_on = "all-reduce"
    """What the end of backward's waits are for, as the hang report names it (``Observer.waiting``)."""
    common_path = True
    """The per-parameter hook's common path may apply (``step.fast_table``)."""
    shards_buckets = False
    """Each bucket padded to a multiple of the world size and reduce-scattered, not all-reduced (ZeRO-2); the
    non-finite check then reads the local gradients before the launch, as under a comm hook."""
    keeps_layout = False
    """The bucket layout is built once at binding and kept (no rebuild from the observed order, no auto-tuning)."""
    defers = False
    """Its rounds may end in the next forward: no serial drain, no tail for the link's verdict."""

    group: Any = None  # a dist.ProcessGroup once set
    comm_hook: CommHook | None = None
    comm_hook_state: Any = None
    hierarchy: HierarchicalAllReduce | None = None

    # ----------------------------------------------------------------- binding (once, between steps)
    def set_collectives(self, group: dist.ProcessGroup, comm_hook: CommHook | None, comm_hook_state: Any,
                        hierarchy: HierarchicalAllReduce | None) -> AllReduce:
        """What ``issue`` launches on: the reducer's group, comm hook and hierarchy, given again when they change."""
        self.group, self.comm_hook, self.comm_hook_state, self.hierarchy = group, comm_hook, comm_hook_state, hierarchy
        return self

    def take_layout(self, buckets: Sequence[Bucket], location: Sequence[tuple[int, int]], names: Sequence[str]) -> None:
        """The buckets built for it (``keeps_layout``): the layout it keeps."""

    def take_hook(self, hook: Any, fused: FusedCompression | None) -> None:
        """A comm hook registered after binding (the wrapper checked its contract): refuse it or take its average."""

    def refuse_join(self) -> str | None:
        """Why ``DistributedDataParallel.join()`` cannot run under it, or None."""
        return None

    def set_joining(self, joining: bool) -> None:
        """``join()``'s context entered or left."""

    # ----------------------------------------------------------------- before forward
    def at_forward_start(self, full: bool) -> None:
        """A forward through the wrapper starts; ``full``: it reads every parameter or re-lays the buckets."""

    def finish(self) -> None:
        """Finish what the next forward's pre-hooks would wait for (the end of a forward, ``finish_step()``)."""

    def round_in_flight(self) -> bool:
        """A backward's round still in flight past its end (the replica check counts it as done)."""
        return False

    # ----------------------------------------------------------------- backward
    def plan(self, plan: StepPlan) -> StepPlan:
        """The backward's plan as this strategy runs it (``step.plan_backward``'s, changed where it must be): made
        when what it depends on changes, not per backward (``Reducer._begin``)."""
        return plan

    def backward_start(self, layout_version: int) -> tuple[list[int] | None, int | None]:
        """A backward starts (a joined rank's shadow too), before its launches: finish what is still in flight;
        return (the order its buckets launch in, None: index order; where it stops launching, None: at none)."""
        return None, None

    def held_backward(self) -> Backward | None:
        """A backward whose buckets still launch after its end (from the next forward), or None."""
        return None

    def copied(self, param: nn.Parameter, bucket: Bucket, slot: int) -> None:
        """``param``'s gradient is in its bucket (off the hook's common path)."""

    def issue(self, bucket: Bucket, step: Backward, last: bool) -> Any:
        """Launch ``bucket``'s collective as ``step.plan`` says (``last``: the last in index order, which carries
        the spare element); return its work (a ``dist.Work`` or a Future). The plain all-reduce of a dense bucket
        goes through the hierarchy where there is one (inside the nodes, then across); a comm hook, the fused
        compress hook and a sparse bucket keep the flat group."""
        plan = step.plan
        # The NaN check first, where it must see the local gradients (a called or fused hook's)
        divided = plan.nonfinite is not None and plan.nonfinite.check_bucket(bucket, plan.divisor, plan.hooked)
        if last:  # the spare element: every rank's flag is summed there (where no hook is called: ``flag_apart``)
            # fill_ with a Python number launches a kernel; ``buffer[-1] = number`` copies a host scalar in, which on
            # CUDA is a synchronizing copy every backward (tests/test_cuda.py's sync check)
            bucket.buffer[-1:].fill_(float(step.missing_flag))
        if plan.fused is not None:
            return plan.fused.launch(bucket, last, self.group)
        if self.comm_hook is not None:
            return _call_hook(self.comm_hook, self.comm_hook_state, bucket, step)
        if bucket.sparse is not None:  # a sparse bucket, divided already (``copy_in``); its flag travels apart
            return all_reduce_sum_clean(bucket.sparse, self.group)
        if plan.mode == VIEW and plan.divisor != 1 and not divided:
            bucket.flat.div_(plan.divisor)  # one pass per bucket instead of one call per parameter
        if bucket.direct is not None:  # the gradient itself (``copy_in``; never the last bucket)
            tensor = bucket.direct
        elif last:
            tensor = bucket.buffer  # with its spare element, and the non-finite count scaled apart from the flag
            if plan.nonfinite is not None:
                plan.nonfinite.add_flag(bucket.buffer)
        else:
            tensor = bucket.flat  # the gradients only, as a direct bucket sends on a rank that went direct
        if self.hierarchy is not None and tensor.is_contiguous():  # its threads issue the stages in this order
            return self.hierarchy.submit(tensor)
        return all_reduce_sum_clean(tensor, self.group)

    def defer(self, step: Backward, missing: list[int]) -> bool:
        """The end of backward: keep the round in flight (True) or finish it now (False)."""
        return False

    def wait(self, buckets: Sequence[Bucket], step: Backward, observer: Observer | None, copy_each: bool) -> float:
        """Wait for every bucket in order (``observer``: told of each wait, or None; ``finish_collectives`` passes one
        only where it takes every event); return the seconds spent waiting. ``copy_each`` (the caller allows it:
        not a joined rank's shadow): where ``copy_back_path`` says so, each bucket's averages go into its gradients
        right after its wait, as torch's reducer finalizes a bucket, so the copy runs while later buckets are still
        in flight instead of after the last one. If another rank then reports a missing gradient, the error comes
        with these gradients already averaged."""
        plan = step.plan
        early = copy_each and copy_back_path(step)[1]
        waited = 0.0
        for bucket in buckets:
            waited += wait_bucket(bucket, bucket is buckets[-1], plan.hooked, observer, early, plan.fused)
        return waited

    def after_collectives(self, buckets: Sequence[Bucket], params: Sequence[nn.Parameter], status: Status,
                          step: Backward) -> None:
        """The agreed status is in and the round finished at the end of its backward (``defer`` declined): the
        averages into ``.grad`` unless copied after each wait already (``wait``'s ``copy_each``)."""
        fast, early = copy_back_path(step)
        if not early:
            copy_back(buckets, params, status.globally_used, step.plan.mode, fast)

    def on_error(self) -> None:
        """The end of backward raised: nothing this backward reduced may reach a step."""

    # ----------------------------------------------------------------- a joined rank's shadow backward (``join``)
    def before_shadow(self) -> None:
        """A joined rank stands in for a backward: as the training ranks' ``zero_grad``."""

    def after_shadow(self, status: Status) -> None:
        """The shadow's collectives are done (the agreed status): as the training ranks' ``opt.step()``."""


# ------------------------------------------- shared by the strategies that hold work past backward
def register_waits(module: nn.Module, params: Sequence[nn.Parameter], finish_params: Callable[[list[int]], None],
                   finish: Callable[[], None]) -> list[Any]:
    """Per module that owns some of ``params``, a forward pre-hook that waits for those parameters alone
    (``finish_params`` with their indices into ``params``, which returns at once where nothing is in flight);
    ``finish`` before the module's state_dict. The overlapped step waits for averaged gradients so, ZeRO-2 for its
    all-gathered parameters."""
    index_of = {id(p): i for i, p in enumerate(params)}
    handles = []
    for sub in module.modules():
        owned = [index_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in index_of]
        if owned:
            handles.append(sub.register_forward_pre_hook(_wait_hook(owned, finish_params)))
    handles.append(module.register_state_dict_pre_hook(lambda *_: finish()))
    return handles


def _wait_hook(owned: list[int], finish_params: Callable[[list[int]], None]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        finish_params(owned)
    return hook


def call_on(optimizer: torch.optim.Optimizer, keep: Callable[[torch.Tensor], bool], call: Callable[[], Any]) -> None:
    """``call()`` with each of ``optimizer``'s param groups narrowed to the parameters ``keep`` accepts (groups left
    empty out); the groups' own dicts are kept, so hyperparameters read and written stay the optimizer's."""
    groups = optimizer.param_groups
    full = [g["params"] for g in groups]
    try:
        narrowed = []
        for g, params in zip(groups, full):
            g["params"] = [p for p in params if keep(p)]
            if g["params"]:
                narrowed.append(g)
        if narrowed:
            optimizer.param_groups = narrowed
            call()
    finally:
        optimizer.param_groups = groups
        for g, params in zip(groups, full):
            g["params"] = params


def _call_hook(hook: CommHook, state: Any, bucket: Bucket, step: Backward) -> Any:
    """``hook(state, GradBucket)``, launched clean (``collectives.clean``); its result must be a Future."""
    work = launch_clean(hook, state, GradBucket(bucket, len(step.pending)))
    if not isinstance(work, torch._C.Future):  # torch.futures.Future and the C++ futures of get_future()
        raise TypeError(f"comm hook {getattr(hook, '__name__', hook)!r} must return a torch.futures.Future, got "
                        f"{type(work).__name__}")
    return work


def wait_bucket(bucket: Bucket, last: bool, hooked: bool, observer: Any, copy_each: bool, fused: Any = None) -> float:
    """``AllReduce.wait`` for one bucket (``last``: the last in index order, which carries the spare element); the
    overlapped optimizer step (``overlap_step``) waits for each bucket where the next forward first needs it.
    ``hooked``: a comm hook's result is put into the bucket (or the direct gradient) where it is not there already.
    ``fused`` (``fused_compress``): the reducer ran the hook's average itself; its result is cast back into the
    bucket, or on the ``copy_each`` path straight into the gradients. Returns the seconds waited."""
    if observer is not None:
        observer.wait_start(bucket.index, bucket.seq)
    start = time.perf_counter()
    result = bucket.work.wait()
    waited = time.perf_counter() - start
    if observer is not None:
        observer.wait_end(bucket.index, bucket.seq)
    if fused is not None:
        fused.finish(bucket, last, copy_each)
        return waited
    if hooked:
        tensor = result[0] if isinstance(result, (list, tuple)) else result
        if bucket.plan.sparse:
            if tensor is not bucket.sparse:
                assert bucket.sparse is not None  # copy_in set it
                bucket.sparse.copy_(tensor)
            return waited
        target = bucket.flat if bucket.direct is None else bucket.direct
        if tensor.data_ptr() != target.data_ptr():
            target.copy_(tensor.view(-1))
    if copy_each and bucket.direct is None and not bucket.plan.sparse:
        # the common path: every one set
        torch._foreach_copy_(cast("list[torch.Tensor]", bucket.grads), bucket.views)
    return waited


def copy_back_path(step: Backward) -> tuple[bool, bool]:
    """At the end of ``step``: (fast, early). ``fast``: ``copy_back``'s common path, each slot copied into its
    ``.grad`` (not with bucket views, a gradient carrying a graph, a missing gradient or a fixup). ``early``: also
    each bucket copied back as soon as its wait returns, torch's order, overlapping the buckets still in flight."""
    fast = not (step.plan.mode == VIEW or step.graph_grads or step.missing_flag or step.fixups)
    return fast, fast and step.plan.copy_each
