"""Test-only fault injection: SIGKILL this worker at a named point of a named step.

The kill -9 tests need kills that land exactly where they mean to (inside backward while
buckets are in flight, between a checkpoint's write and its rename), which a timer cannot
do. So the Trainer and the checkpoint writer call ``maybe_kill(phase, step)`` at a few
points, and this module reads one environment variable:

    LOCKSTEP_TEST_KILL_AT="step=7,phase=backward,rank=1"      (optional: ",attempt=0")

``phase`` is one of PHASES (ckpt_open: the temporary file was just opened; ckpt_write:
64 KiB of it written; ckpt_rename: written and fsynced, not yet renamed; ckpt_meta:
renamed, its checksum file not yet written); ``step`` is the optimizer step being computed (forward,
backward, optimizer) or the step whose checkpoint is being written (ckpt_*); ``rank`` the
global rank to kill; ``attempt`` the elastic attempt (TORCHELASTIC_RESTART_COUNT, default
0) so that a restarted group runs through. The process is killed with SIGKILL: no
exception, no ``finally``, no flush; exactly what the OOM killer or a node loss does.

Test-only, and free when unset: ``kill_point_from_env`` returns None, the Trainer keeps
None, and no hook is installed; each call site is one ``is not None`` test.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

ENV_VAR = "LOCKSTEP_TEST_KILL_AT"
PHASES = ("forward", "backward", "optimizer", "ckpt_open", "ckpt_write", "ckpt_rename", "ckpt_meta")
CKPT_WRITE_KILL_AFTER_NBYTES = 64 * 1024  # "mid-write": once this much of the temporary file is written


@dataclass(frozen=True)
class KillPoint:
    step: int
    phase: str
    rank: int
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"{ENV_VAR}: phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.step < 1 or self.rank < 0 or self.attempt < 0:
            raise ValueError(f"{ENV_VAR}: step must be >= 1 and rank, attempt >= 0, got {self}")

    def __str__(self) -> str:
        return f"step={self.step},phase={self.phase},rank={self.rank},attempt={self.attempt}"


def parse_kill_point(text: str) -> KillPoint:
    """``"step=7,phase=backward,rank=1"`` -> KillPoint; a ValueError names the bad part."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("step", "phase", "rank", "attempt"):
            raise ValueError(f"{ENV_VAR}={text!r}: expected step=N,phase=P,rank=R[,attempt=A], got {part!r}")
        fields[key] = value.strip()
    missing = {"step", "phase", "rank"} - fields.keys()
    if missing:
        raise ValueError(f"{ENV_VAR}={text!r}: missing {', '.join(sorted(missing))}")
    try:
        return KillPoint(int(fields["step"]), fields["phase"], int(fields["rank"]), int(fields.get("attempt", 0)))
    except ValueError as e:
        raise ValueError(f"{ENV_VAR}={text!r}: {e}") from None


def kill_point_from_env(rank: int, env=os.environ) -> KillPoint | None:
    """The kill point meant for this rank in this attempt, or None (the normal case: unset)."""
    text = env.get(ENV_VAR)
    if not text:
        return None
    point = parse_kill_point(text)
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return point if point.rank == rank and point.attempt == attempt else None


def maybe_kill(point: KillPoint | None, phase: str, step: int) -> None:
    """SIGKILL this process if ``point`` names this phase and step."""
    if point is not None and point.phase == phase and point.step == step:
        # the one line the test reads to know the kill landed where it meant
        sys.stderr.write(f"lockstep test: SIGKILL at {point} (pid {os.getpid()})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def install_kill_hooks(trainer, point: KillPoint) -> None:
    """Hooks for the training phases (checkpoint phases are checked by the writer itself)."""
    from lockstep.ddp.observe import StepObserver

    if point.phase in ("forward", "backward"):

        class _KillObserver(StepObserver):
            def forward_end(self) -> None:  # inside DDP's forward: the module ran, forward has not returned
                maybe_kill(point, "forward", trainer.step + 1)

            def bucket_launched(self, bucket_index: int, seq: int) -> None:  # a bucket's all-reduce is in flight
                maybe_kill(point, "backward", trainer.step + 1)

        reducer = trainer.ddp.reducer
        reducer.attach_observer(_KillObserver())
    elif point.phase == "optimizer":
        # after the update, before the step is counted: parameters in memory already differ from any checkpoint
        trainer.optimizer.register_step_post_hook(lambda *_: maybe_kill(point, "optimizer", trainer.step + 1))
