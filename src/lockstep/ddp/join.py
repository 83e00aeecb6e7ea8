"""Uneven inputs: a rank that has run out of data shadows the collectives of the ranks still training.

Built on torch's generic ``torch.distributed.algorithms.join.Join``: each training
forward announces "not joined yet" with a one-element all-reduce; a joined rank
answers each such round by issuing, with zeros, exactly the collectives one
training iteration issues (bucket rebuild, buffer broadcast, bucket all-reduces,
status), so nobody waits for a partner that left. When everyone has joined, the
rank that trained longest broadcasts its parameters and buffers, and all replicas
end identical.

Inside a join context every forward follows torch's protocol, collective for collective: the
"not joined" all-reduce, the bucket rebuild (once), the buffers broadcast from the highest rank
still training (``common_rank``: one all-reduce and a host read, only inside join), and a
one-element all-reduce telling the joined ranks whether this iteration's backward synchronises
(so ``no_sync`` micro-batches work under join: the joined ranks skip the shadow backward).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from lockstep.ddp.lifetime import bury
from lockstep.ddp.replicas import broadcast_coalesced


class ShadowingReducer(Protocol):
    """What a joined rank asks of the reducer: the between-steps work and one backward's collectives, with zeros
    (``Reducer.shadow_backward``, which runs the same ``schedule.finish_collectives`` as a training rank)."""

    def between_steps(self) -> None: ...
    def shadow_backward(self) -> None: ...


class JoinableDDP(Protocol):
    """What the join hook reads of the wrapper; stated here so this module need not import it."""

    module: torch.nn.Module
    process_group: dist.ProcessGroup
    _divide_by_initial_world_size: bool
    _join_used: bool
    _authoritative_rank: int
    _join_sync_work: dist.Work | None
    require_forward_param_sync: bool
    forward_sync_buffers: bool

    @property
    def reducer(self) -> ShadowingReducer: ...
    @property
    def join_device(self) -> torch.device: ...
    @property
    def _sync_buffers(self) -> list[torch.Tensor]: ...
    def _will_sync_buffers(self) -> bool: ...
    def finish_step(self) -> None: ...


class DDPJoinHook(JoinHook):
    """What a joined rank does per round (``main_hook``) and once all have joined (``post_hook``)."""

    def __init__(self, ddp: JoinableDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        # The training ranks read this in forward: divide by everyone, or by the ranks still training.
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        ddp._join_used = True  # reported as torch's logging key join_uneven_inputs

    def main_hook(self) -> None:
        ddp = self.ddp
        reducer = ddp.reducer
        reducer.between_steps()  # the bucket rebuild and auto-tuning switches, as the training ranks' forward
        if ddp.require_forward_param_sync and ddp._will_sync_buffers():
            broadcast_coalesced(ddp._sync_buffers, ddp.process_group, common_rank(ddp, False))
        should_sync = backward_sync_round(ddp, False, joined=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        ddp.finish_step()  # ZeRO-2's all-gathers of the last step land before the broadcast writes the parameters
        # The highest rank among those that joined last holds the fully trained state.
        candidate = torch.tensor([dist.get_rank(ddp.process_group) if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=ddp.process_group)
        authoritative = int(candidate.item())
        ddp._authoritative_rank = authoritative  # torch's attribute name: the rank whose state every rank takes
        buffers = ddp._sync_buffers if ddp.forward_sync_buffers else []
        broadcast_coalesced(list(ddp.module.parameters()) + buffers, ddp.process_group, authoritative)


def common_rank(ddp: JoinableDDP, candidate: bool) -> int:
    """The highest rank (in the DDP's group) among those passing ``candidate=True``: rank 0 may have
    joined with stale buffers, so under join the buffers come from a rank still training, as torch's.
    Costs one all-reduce and a host read, only inside a join context.
    """
    rank = torch.tensor([dist.get_rank(ddp.process_group) if candidate else -1], device=ddp.join_device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    return int(rank.item())


def notify_not_joined(ddp: JoinableDDP) -> dist.Work | None:
    """torch's "not joined yet" all-reduce of this forward (``Join.notify_join_context``), its work kept in
    ``lifetime``'s graveyard until done. A forward that raises drops it in flight; if the process group is then
    freed at exit (the traceback lets go of the DDP object), torch 2.4 joins gloo's worker holding the GIL while
    that worker waits for the GIL to free the work's tensor: a hang, seen in torch's
    ``test_ddp_uneven_input_exception``."""
    work = Join.notify_join_context(ddp)  # type: ignore[arg-type]
    bury((work,))
    return work


def join_divisor(ddp: JoinableDDP, join_work: dist.Work | None) -> int:
    """The average's denominator for this forward: the world size, or under ``join(divide_by_initial_world_size=False)``
    the ranks still training (the "not joined" all-reduce's sum: a host sync per forward, only there)."""
    if join_work is None or ddp._divide_by_initial_world_size:
        return dist.get_world_size(ddp.process_group)
    join_work.wait()
    return int(join_work.result()[0].item())


def backward_sync_round(ddp: JoinableDDP, synced: bool, joined: bool) -> bool:
    """One all-reduce per forward inside join: does any training rank synchronise this backward?

    A training rank does not wait (its work is kept until the next round, see ``lifetime``); a
    joined rank waits and returns the answer.
    """
    flag = torch.ones(1, device=ddp.join_device) if synced and not joined else torch.zeros(1, device=ddp.join_device)
    work = dist.all_reduce(flag, group=ddp.process_group, async_op=True)
    if not joined:
        bury((work,))  # as notify_not_joined's: a forward that raises leaves it in flight
        ddp._join_sync_work = work
        return synced
    work.wait()
    return bool(flag.item() != 0)
