"""The naive reducer: after backward, one blocking all-reduce per parameter. No buckets, no overlap.

It is the reference the real reducer is tested against and the baseline the
benchmarks measure: each parameter costs a full collective (~0.5 ms on gloo however
small), and nothing starts before backward ends.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lockstep.collectives.clean import launch_clean
from lockstep.ddp.replicas import broadcast_coalesced
from lockstep.ddp.wrapper import DistributedDataParallel


class NaiveDistributedDataParallel(nn.Module):
    """Wrap ``module``; every synchronised backward ends with ``all_reduce(grad) / world_size`` per parameter.

    Rank 0's parameters and buffers are broadcast at construction, as in DDP. ``no_sync()``
    accumulates locally; buffers are not synchronised after construction.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"NaiveDistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}"
            )
        self.module = module
        # dist.group.WORLD is typed Optional: it is set once a process group is initialised, as DDP requires
        self.process_group = process_group if process_group is not None else cast(dist.ProcessGroup, dist.group.WORLD)
        self.world_size = dist.get_world_size(self.process_group)
        self.require_backward_grad_sync = True
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._expect = False
        self._queued = False
        self._last_works: list = []
        broadcast_coalesced(list(module.parameters()) + list(module.buffers()), self.process_group)
        # Any hook will do to learn that backward is running; the work happens in the end-of-backward callback.
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._expect = torch.is_grad_enabled() and self.require_backward_grad_sync
        return self.module(*inputs, **kwargs)

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self._expect and not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._all_reduce_grads)
            self._queued = True

    def _all_reduce_grads(self) -> None:
        self._queued = False
        self._expect = False
        works = []  # kept until the next backward: gloo's thread must not free them (see ddp/lifetime.py)
        for p in self._params:
            if p.grad is None:
                raise RuntimeError("NaiveDistributedDataParallel: a parameter received no gradient")
            works.append(launch_clean(dist.all_reduce, p.grad, group=self.process_group, async_op=True))
            works[-1].wait()  # blocking: one collective per parameter, one after the other
            p.grad.div_(self.world_size)
        self._last_works = works

    # The same switch as the real DDP's: it only toggles require_backward_grad_sync.
    no_sync = DistributedDataParallel.no_sync
