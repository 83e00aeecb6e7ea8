"""Preemption: on SIGTERM every rank finishes the current step, a checkpoint is written, the job asks to be requeued.

SLURM (``--signal``), spot instances and Kubernetes send SIGTERM some seconds before they
kill. A handler that only sets a flag cannot stop one rank alone (the others would wait in
the next all-reduce), so the ranks agree on the step to stop at: after each optimizer step
every rank issues an asynchronous MAX all-reduce of its flag and reads the result one step
later. All ranks therefore see the same answer after the same step and stop together,
at most two steps after the signal. The cost per step is one 4-byte all-reduce that runs
while the next step computes (measured in docs/fault-tolerance.md: within noise of no check).

Exit code: ``REQUEUE_EXIT_CODE`` = 75, sysexits.h's EX_TEMPFAIL ("temporary failure; try
again"). ``lockstep launch`` passes it on, and ``lockstep slurm-script`` requeues the job
on it (``scontrol requeue``; or set ``RequeueExit=75`` in slurm.conf).

Further SIGTERMs are ignored (the scheduler and the launcher's agent both send one); SIGKILL,
which the agent sends after its shutdown timeout, is the hard stop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lockstep.ddp.lifetime import bury
from lockstep.slurm import (  # the contract with launch/, at the bottom layer
    CHECKPOINT_NOTE,
    PREEMPT_DIR_ENV,
    REQUEUE_EXIT_CODE,
)

__all__ = ["PREEMPT_DIR_ENV", "REQUEUE_EXIT_CODE", "Preempted", "PreemptionWatch", "leave_marker", "note_checkpoint"]


class Preempted(SystemExit):
    """Raised by ``Trainer.fit()`` after the preemption checkpoint: the process exits with REQUEUE_EXIT_CODE.

    A SystemExit, so ``finally`` blocks (``lockstep.shutdown()``) run and nothing prints a traceback;
    catch it to do something else.
    """

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(REQUEUE_EXIT_CODE)
        self.step, self.checkpoint = step, checkpoint


class PreemptionWatch:
    """A SIGTERM flag, agreed on by every rank of ``group`` one step after it was raised anywhere."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, signum: int = signal.SIGTERM):
        self.group, self.device, self.signum = group, device, signum
        self.requested = False  # this rank received the signal
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None  # signal.signal's return
        self._work = None  # the all-reduce issued after the previous step
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers live in the main thread; elsewhere only another rank's flag stops us
        self._previous = signal.signal(self.signum, self._handle)
        self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            # Repeats are expected, not an escalation: SLURM or systemd signal every process while the
            # launcher's agent forwards its own SIGTERM. The agent's SIGKILL after its shutdown timeout
            # (`lockstep launch --shutdown-timeout`, default 15 s) stops a rank that cannot finish.
            return
        self.requested = True
        sys.stderr.write(f"lockstep: {signal.Signals(signum).name} received; finishing the current step on every "
                         f"rank, then writing a checkpoint (pid {os.getpid()})\n")
        sys.stderr.flush()

    def should_stop(self) -> bool:
        """Call once per optimizer step on every rank: True on all ranks alike, after the same step."""
        if self._work is not None:
            self._work.wait()  # issued a step ago: normally done by now
            self._work = None
            if self._flag.item():
                return True
        self._flag.fill_(1 if self.requested else 0)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        bury((self._work,))  # a step that raises drops it in flight: see ddp/lifetime.py (torch 2.4's exit hang)
        return False

    def forget_pending(self) -> None:
        """Drop the outstanding all-reduce: its group is gone (in-place recovery re-formed it); the flag stays."""
        self._work = None

    def drain(self) -> None:
        """Wait for the outstanding all-reduce (before the group's next collectives, at the end of training)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def leave_marker(rank: int, step: int, checkpoint: str | None) -> None:
    """Tell ``lockstep launch`` (through PREEMPT_DIR_ENV) that this rank checkpointed and is exiting to be requeued."""
    directory = os.environ.get(PREEMPT_DIR_ENV)
    if directory:
        try:
            Path(directory, f"rank{rank}").write_text(f"step {step} checkpoint {checkpoint}\n")
        except OSError:
            pass  # the exit code still says it; the marker only lets the launcher confirm it


def note_checkpoint(path: Path) -> None:
    """Tell ``lockstep launch`` (through PREEMPT_DIR_ENV) the newest checkpoint written, so that a Ctrl-C of the
    job names it. Replaced atomically: a stop between two saves reads one whole path."""
    directory = os.environ.get(PREEMPT_DIR_ENV)
    if directory:
        note = Path(directory, CHECKPOINT_NOTE)
        try:
            note.with_suffix(".tmp").write_text(f"{Path(path).resolve()}\n")
            os.replace(note.with_suffix(".tmp"), note)
        except OSError:
            pass  # the launcher's folder is gone: only the stop line loses the name
