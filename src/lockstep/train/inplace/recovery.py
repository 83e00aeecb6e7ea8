"""The caller's side of in-place recovery, written once: the Trainer and a script's ``InPlaceRecovery`` both hold one.

``Recovery`` stands between a training loop and its ``InPlaceGroup``: it commits each step, admits the nodes
waiting at a step boundary and hands them rank 0's state (``broadcast_state``), turns a failed collective into the
re-formation the survivors agreed on, and re-binds the loop's DDP and re-deals its sampler at the new size. What
differs between loops (what state a newcomer needs, what else changes at a new size) is the loop's own, behind
``RecoveringLoop``: a Trainer carries its epoch, scaler and checkpoint folder; a script's loop its step count and
scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.train.inplace.group import InPlaceGroup
from lockstep.train.inplace.outcome import PeerLost, Regrouped
from lockstep.train.resize import derived_rng_state


class RecoveringLoop(Protocol):
    """A training loop under in-place recovery: its DDP, optimizer and sampler, and what only it knows."""

    ddp: Any  # lockstep's DistributedDataParallel over the default group
    optimizer: torch.optim.Optimizer
    sampler: Any  # lockstep's DistributedSampler

    def live_state(self) -> dict:
        """Rank 0's: what a newcomer needs to take the next step as if it had trained all along (no copies:
        ``broadcast_state`` flattens the tensors)."""
        ...

    def adopt(self, state: dict) -> None:
        """A newcomer takes ``live_state()`` of rank 0."""
        ...

    def committed_sampler_state(self) -> dict:
        """The sampler's position as the last committed step left it: re-dealt at the new size."""
        ...

    def committed_step(self) -> int:
        """The last committed step (a newcomer's RNG is derived from it, as a resume's for a new rank)."""
        ...

    def resized(self, outcome: Regrouped) -> None:
        """What else the loop changes at the new size, once its DDP was re-bound and its sampler re-dealt."""
        ...

    def ddp_group(self) -> dist.ProcessGroup | None:
        """The group its DDP is re-bound to at the new size (None: the new default group), after making any group
        the loop's parts need there: every rank calls it at the same point, so it may make groups."""
        ...


class Recovery:
    """One loop's side of in-place recovery over ``group``; ``loop`` is read only through ``RecoveringLoop``."""

    def __init__(self, group: InPlaceGroup, loop: RecoveringLoop):
        self.group, self.loop = group, loop
        self._report: Regrouped | None = None  # the last re-formation, said after the first step at its size
        self._resumed_at = 0  # the step the loop went on from after it (DiLoCo's: its last sync, before the commit)

    @property
    def joining(self) -> bool:
        """This process joins a running job (a node come back) and has not taken its state yet."""
        return self.group.joined is not None

    @property
    def grow_due(self) -> bool:
        """The last commit said nodes wait: admit them at this step boundary (``grow``)."""
        return self.group.grow_due

    def join(self) -> Regrouped | None:
        """A newcomer, once its loop is built: take the running job's state (the others wait in ``grow``). None
        where this process is no newcomer."""
        joined = self.group.joined
        if joined is not None:
            self._take_over(joined)
        return joined

    def commit(self, step: int) -> Regrouped | None:
        """``InPlaceGroup.commit``: None as usual; a ``Regrouped`` where this rank applies ``step`` all the same
        (roll forward: call ``regroup`` after the step); raises ``PeerLost`` where the step is discarded."""
        return self.group.commit(step)

    def grow(self) -> Regrouped | None:
        """Every rank, at the boundary after the commit that said nodes wait: admit them, hand them the state, and
        re-deal at the new size. None when nobody was admitted (the newcomers fell silent)."""
        outcome = self.group.grow()
        if outcome is not None:
            self._take_over(outcome)
        return outcome

    def lost(self, error: BaseException) -> Regrouped:
        """A step failed with ``error``: the re-formation the survivors agreed on (raises what is no peer loss).
        The caller rolls its own fields back to the last committed step, then calls ``regroup``."""
        return error.outcome if isinstance(error, PeerLost) else self.group.rejoin(error)

    def regroup(self, outcome: Regrouped) -> None:
        """The loop at the new size: its DDP re-bound to the new group (``ddp_group``), the sampler re-dealt from
        the last committed position (the global batch kept), the loop's own fields (``resized``); the launcher's
        line after the first step at this size (``report``)."""
        self.loop.optimizer.zero_grad(set_to_none=True)  # a discarded step's gradients (none after an applied one)
        self.loop.ddp.rebind(self.loop.ddp_group())
        self.loop.sampler.num_replicas, self.loop.sampler.rank = outcome.world_size, outcome.rank
        self.loop.sampler.load_state_dict(self.loop.committed_sampler_state())
        self.loop.resized(outcome)
        self.group.settle()
        self._report, self._resumed_at = outcome, self.loop.committed_step()

    def report(self, step: int) -> None:
        """After a step at the new size (or the last checkpoint where no step follows): the launcher's line for the
        last re-formation, once."""
        if self._report is not None:
            self.group.report(self._report, step, self._resumed_at)
            self._report = None

    def _take_over(self, outcome: Regrouped) -> None:
        """Every rank of a grown group (the survivors at the step boundary, the newcomers at their start): the same
        collectives in the same order. Rank 0's ``live_state()`` reaches every rank (``broadcast_state``); the
        newcomers ``adopt`` it; all ``regroup``; a newcomer's RNG is then derived from (seed, the adopted step, its
        rank), as a resume at the larger size gives a rank that did not exist (train/resize.py)."""
        state = broadcast_state(self.loop.live_state() if dist.get_rank() == 0 else None)
        assert isinstance(state, dict)
        if outcome.newcomer:
            self.loop.adopt(state)  # its replicas now equal rank 0's; rebind's check at the first forward says so
        self.regroup(outcome)
        if outcome.newcomer:
            self.group.took_admission()
            derived_rng_state(self.loop.sampler.seed, self.loop.committed_step(), outcome.rank)


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a state sent by ``broadcast_state``: its index in the flat buffer of its dtype."""

    dtype: str
    offset: int
    shape: tuple[int, ...]


def broadcast_state(state: object | None, src: int = 0) -> object:
    """``state`` of group rank ``src`` (nested dicts, lists and tuples of tensors and plain values) on every rank.

    The plain values and the tensors' shapes go in one pickled broadcast; the tensors' data in one broadcast per
    dtype, flattened (no pickling of tensor data, two or three collectives for a model and its optimizer)."""
    flats: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def strip(x):
        if isinstance(x, torch.Tensor):
            dtype = str(x.dtype).removeprefix("torch.")
            flats.setdefault(dtype, []).append(x.detach().reshape(-1).cpu())
            offset = sizes.get(dtype, 0)
            sizes[dtype] = offset + x.numel()
            return _Slot(dtype, offset, tuple(x.shape))
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x

    box = [(strip(state), sizes) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    skeleton, sizes = box[0]  # type: ignore[misc]
    buffers = {}
    for dtype in sorted(sizes):  # the same order on every rank
        buffers[dtype] = (torch.cat(flats[dtype]) if dist.get_rank() == src
                          else torch.empty(sizes[dtype], dtype=getattr(torch, dtype)))
        dist.broadcast(buffers[dtype], src=src)

    def fill(x):
        if isinstance(x, _Slot):
            numel = math.prod(x.shape)
            return buffers[x.dtype][x.offset:x.offset + numel].view(x.shape).clone()
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x

    return fill(skeleton)
