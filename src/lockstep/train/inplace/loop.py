"""``InPlaceRecovery``: in-place recovery for a script's own training loop, one call per optimizer step.

The script keeps its loop (docs/preemptible.md, "Your own loop"); this object is its ``RecoveringLoop``: the step
count, the sampler's committed position, the scheduler a newcomer takes. Committing, admitting, re-forming and
re-dealing are ``Recovery``'s, the same the Trainer uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.train.inplace.group import InPlaceGroup
from lockstep.train.inplace.outcome import PeerLost, PeersJoined, Regrouped
from lockstep.train.inplace.recovery import Recovery


class InPlaceRecovery:
    """A script's loop with in-place recovery: one call per optimizer step.

    Args:
        ddp: lockstep's DistributedDataParallel over the default group.
        optimizer: stepped by ``step`` once every rank's averages completed.
        sampler: lockstep's DistributedSampler; re-dealt at the new size from the last committed position.
        scheduler: an LR scheduler stepped by the script, if any: a node that joins takes its state too.

    Call ``set_epoch(epoch)`` instead of the sampler's at each epoch's start. ``step(fn)`` runs ``fn()`` (this
    step's forward and backward passes), commits, then steps the optimizer and zeroes the gradients. When a peer is
    lost it raises ``PeerLost`` once the group re-formed, the model was re-bound and the sampler re-dealt: start the
    DataLoader's iteration again (docs/preemptible.md). Where this step was applied all the same (the others had
    committed it: roll forward), ``step`` returns, and the next ``step`` raises before its ``fn``. A node that comes
    back joins at the next step boundary: the next ``step`` (before ``fn``) or ``set_epoch`` admits it and hands it
    this job's state over the group; ``step`` then raises ``PeersJoined``, a ``PeerLost``. In the joining process
    (the same script, started by ``lockstep launch`` on that node) this constructor receives the state, and
    ``set_epoch`` leaves the epochs the job had finished empty (it returns False for them) and resumes the current
    one where the others stand.
    """

    def __init__(self, ddp, optimizer: torch.optim.Optimizer, sampler, group: InPlaceGroup | None = None, *,
                 scheduler=None):
        self.ddp, self.optimizer, self.sampler, self.scheduler = ddp, optimizer, sampler, scheduler
        self.group = group if group is not None else InPlaceGroup()
        self.recovery = Recovery(self.group, self)
        self.step_count = 0
        self._sampler_state = sampler.state_dict()  # the position the last committed step left
        self._handed: dict | None = None  # a newcomer: the job's sampler state, until ``set_epoch`` reaches its epoch
        self._rolled_forward: Regrouped | None = None  # a re-formation after an applied step: raised at the next step
        self.group.accept_joins()  # a node that comes back joins at a step boundary (launch/rendezvous.py)
        self.recovery.join()  # this process is such a node: the others wait in ``Recovery.grow`` now

    def set_epoch(self, epoch: int) -> bool:
        """``sampler.set_epoch(epoch)``, noting the epoch's start (or resumed position) as the committed one.
        False (the loader then yields nothing) in a process that joined the job after it finished ``epoch``."""
        handed, self._handed = self._handed, None
        self._rolled_forward = None  # a new epoch's loader is dealt at the new size: nothing to iterate again
        if handed is not None and epoch < handed["epoch"]:
            self._handed = handed
            self.sampler.set_epoch(epoch)
            self.sampler.load_state_dict(_epoch_done(self.sampler, epoch))
            return False
        if handed is not None and epoch == handed["epoch"]:
            self.sampler.load_state_dict(handed)  # where the others stand; set_epoch would start the epoch over
        else:
            self.sampler.set_epoch(epoch)
        self._sampler_state = self.sampler.state_dict()
        if self.recovery.grow_due:  # the last step's commit said nodes wait: admit them before this epoch's first batch
            self.recovery.grow()
        return True

    def step(self, fn: Callable[[], object]) -> object:
        if self._rolled_forward is not None:  # the last step was applied and the group re-formed meanwhile
            applied, self._rolled_forward = self._rolled_forward, None
            raise PeerLost(applied)  # this batch was dealt at the old layout: iterate the loader again
        if self.recovery.grow_due:  # the last step's commit said nodes wait: admit them at this boundary, before fn
            outcome = self.recovery.grow()
            if outcome is not None:
                raise PeersJoined(outcome)  # this batch was dealt at the old size: iterate the loader again
        try:
            result = fn()
            regrouped = self.recovery.commit(self.step_count + 1)
        except Exception as e:
            outcome = self.recovery.lost(e)  # re-raises what is no peer loss
            self.recovery.regroup(outcome)
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(outcome) from e
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self._sampler_state = self.sampler.state_dict()
        self.recovery.report(self.step_count)
        if regrouped is not None:
            # This rank applied the step the others had committed (roll forward). It returns as they did, so that
            # the script's code after step() (its scheduler.step(), its counters) runs for this step here too; the
            # next step() raises PeerLost before its fn. Raising now skipped that code on this rank alone: its LR
            # schedule fell one step behind the others'.
            self.recovery.regroup(regrouped)
            self._rolled_forward = regrouped
        return result

    # -- RecoveringLoop: what Recovery asks of this loop ---------------------------------------------------------
    def live_state(self) -> dict:
        return {"model": self.ddp.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "sampler": self._sampler_state, "step": self.step_count}

    def adopt(self, state: dict) -> None:
        self.ddp.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
        self._sampler_state = self._handed = state["sampler"]

    def committed_sampler_state(self) -> dict:
        return self._sampler_state

    def committed_step(self) -> int:
        return self.step_count

    def resized(self, outcome: Regrouped) -> None:
        pass  # nothing else of a script's loop depends on the world size: the script reads the sampler's

    def ddp_group(self) -> dist.ProcessGroup | None:
        return None  # the script's DDP runs on the default group


def _epoch_done(sampler, epoch: int) -> dict:
    """A sampler state at the end of ``epoch`` (its next iteration yields nothing), at the sampler's world size."""
    n, replicas = len(sampler.dataset), sampler.num_replicas
    return {**sampler.state_dict(consumed=0), "epoch": epoch, "position": n, "consumed": n // replicas}
