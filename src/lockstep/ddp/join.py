"""Uneven inputs: a rank that has run out of data shadows the collectives of the ranks still training.

Built on torch's generic ``torch.distributed.algorithms.join.Join``: each training
forward announces "not joined yet" with a one-element all-reduce; a joined rank
answers each such round by issuing, with zeros, exactly the collectives one
training iteration issues (bucket rebuild, buffer broadcast, bucket all-reduces,
status), so nobody waits for a partner that left. When everyone has joined, the
rank that trained longest broadcasts its parameters and buffers, and all replicas
end identical.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from lockstep.ddp.replicas import broadcast_coalesced


class JoinableDDP(Protocol):
    """What the join hook reads of the wrapper; stated here so this module need not import it."""

    module: torch.nn.Module
    reducer: Any
    process_group: dist.ProcessGroup
    join_device: torch.device
    _sync_buffers: list[torch.Tensor]
    _divide_by_initial_world_size: bool

    def _will_sync_buffers(self) -> bool: ...


class DDPJoinHook(JoinHook):
    """What a joined rank does per round (``main_hook``) and once all have joined (``post_hook``)."""

    def __init__(self, ddp: JoinableDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        # The training ranks read this in forward: divide by everyone, or by the ranks still training.
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        reducer = ddp.reducer
        reducer.between_steps()  # the bucket rebuild and auto-tuning switches, as the training ranks' forward
        if ddp._will_sync_buffers():
            broadcast_coalesced(ddp._sync_buffers, ddp.process_group)
        reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        # The highest rank among those that joined last holds the fully trained state.
        candidate = torch.tensor([dist.get_rank(ddp.process_group) if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=ddp.process_group)
        authoritative = int(candidate.item())
        ddp._authoritative_rank = authoritative  # torch's attribute name: the rank whose state every rank takes
        broadcast_coalesced(list(ddp.module.parameters()) + ddp._sync_buffers, ddp.process_group, authoritative)
