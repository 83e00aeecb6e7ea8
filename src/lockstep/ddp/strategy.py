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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.ddp.copy_back import copy_back, wait_buckets
from lockstep.ddp.reducer_state import Bucket, Status

if TYPE_CHECKING:
    from lockstep.ddp.fused_compress import FusedCompression
    from lockstep.ddp.observe import Observer
    from lockstep.ddp.step import Backward, StepPlan


class AllReduce:
    """DDP's reduction: every bucket all-reduced (``schedule.issue_bucket``), averages back into ``.grad``."""

    name = "all-reduce"
    common_path = True
    """The per-parameter hook's common path may apply (``step.fast_table``)."""
    shards_buckets = False
    """Each bucket padded to a multiple of the world size and reduce-scattered, not all-reduced (ZeRO-2); the
    non-finite check then reads the local gradients before the launch, as under a comm hook."""
    keeps_layout = False
    """The bucket layout is built once at binding and kept (no rebuild from the observed order, no auto-tuning)."""
    defers = False
    """Its rounds may end in the next forward: no serial drain, no tail for the link's verdict."""

    # ----------------------------------------------------------------- binding (once, between steps)
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
    def at_backward_start(self) -> None:
        """A backward starts (before its plan and its launches)."""

    def plan(self, plan: StepPlan) -> StepPlan:
        """The backward's plan as this strategy runs it (``step.plan_backward``'s, changed where it must be)."""
        return plan

    def launch_sequence(self, layout_version: int) -> tuple[list[int] | None, int | None]:
        """(the order the buckets launch in, None: index order; where a backward stops launching, None: all)."""
        return None, None

    def held_backward(self) -> Backward | None:
        """A backward whose buckets still launch after its end (from the next forward), or None."""
        return None

    def copied(self, param: nn.Parameter, bucket: Bucket, slot: int) -> None:
        """``param``'s gradient is in its bucket (off the hook's common path)."""

    def bucket_full(self, buckets: Sequence[Bucket], launched: int) -> None:
        """A bucket's last gradient landed and the first ``launched`` buckets are issued."""

    def issue(self, bucket: Bucket, step: Backward) -> Any:
        """Issue ``bucket``'s collective; return its work. None: the reducer's all-reduce (``schedule``)."""
        return None

    def defer(self, step: Backward, missing: list[int]) -> bool:
        """The end of backward: keep the round in flight (True) or finish it now (False)."""
        return False

    def wait(self, buckets: Sequence[Bucket], plan: StepPlan, observer: Observer | None, copy_each: bool) -> float:
        """Wait for every bucket's collective; seconds waited. ``copy_each``: each average into ``.grad`` at once."""
        return wait_buckets(buckets, plan.hooked, observer, copy_each, plan.fused)

    def after_collectives(self, buckets: Sequence[Bucket], params: Sequence[nn.Parameter], status: Status,
                          mode: str, fast: bool, copied: bool) -> None:
        """The agreed status is in: the averages into ``.grad`` unless ``copied`` after each wait already."""
        if not copied:
            copy_back(buckets, params, status.globally_used, mode, fast)

    def round_closed(self) -> None:
        """The reducer finished a round at the end of its backward (``defer`` declined)."""

    def on_error(self) -> None:
        """The end of backward raised: nothing this backward reduced may reach a step."""

    # ----------------------------------------------------------------- a joined rank's shadow backward (``join``)
    def before_shadow(self) -> None:
        """A joined rank stands in for a backward: as the training ranks' ``zero_grad``."""

    def after_shadow(self, status: Status) -> None:
        """The shadow's collectives are done (the agreed status): as the training ranks' ``opt.step()``."""


# ------------------------------------------- shared by the strategies that hold work past backward
def register_waits(module: nn.Module, params: Sequence[nn.Parameter], in_flight: Callable[[], bool],
                   finish_params: Callable[[list[int]], None], finish: Callable[[], None]) -> list[Any]:
    """Per module that owns some of ``params``, a forward pre-hook that, while ``in_flight()``, waits for those
    parameters alone (``finish_params`` with their indices into ``params``); ``finish`` before the module's
    state_dict. The overlapped step waits for averaged gradients so, ZeRO-2 for its all-gathered parameters."""
    index_of = {id(p): i for i, p in enumerate(params)}
    handles = []
    for sub in module.modules():
        owned = [index_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in index_of]
        if owned:
            handles.append(sub.register_forward_pre_hook(_wait_hook(owned, in_flight, finish_params)))
    handles.append(module.register_state_dict_pre_hook(lambda *_: finish()))
    return handles


def _wait_hook(owned: list[int], in_flight: Callable[[], bool],
               finish_params: Callable[[list[int]], None]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        if in_flight():
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
