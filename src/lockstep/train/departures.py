"""Why a rank left training, told to the ranks it left behind.

When one rank leaves ``fit()`` early (an exception, or a ``sys.exit(0)`` in a callback) the
others only see their next collective fail ("Connection closed by peer"), which names no
cause. So a leaving rank writes one line to the process group's key-value store (the
TCPStore every rank already talks to), and a rank whose own step fails reads the others'
lines and raises an error that names the rank that left, the step and the reason.

Cost: nothing on the normal path; one store write when a rank leaves, one read per rank
when a step fails. The store lives in global rank 0's process: if rank 0 is the one gone,
the others say so instead.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

# One key space per fit(): ranks call fit() equally often, so the n-th fit of every rank shares a number
# and a departure from an earlier fit in the same process group is never read as a new one.
_KEY = "lockstep/trainer/{fit}/left/{rank}"
_fits = itertools.count()


def next_fit() -> int:
    return next(_fits)


def is_communication_failure(error: BaseException) -> bool:
    """A collective failed (gloo/NCCL errors are plain RuntimeErrors or torch's DistError), not the code around it."""
    return type(error) is RuntimeError or isinstance(error, getattr(dist, "DistError", ()))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()  # torch's own store; no public accessor
    except Exception:
        return None


def announce_departure(fit: int, rank: int, step: int, error: BaseException) -> None:
    """Record (best effort) that ``rank`` left training after ``step`` because of ``error``."""
    store = _store()
    if store is None:
        return
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    try:
        store.set(_KEY.format(fit=fit, rank=rank), f"rank {rank} left training after step {step} ({what})")
    except Exception:
        pass  # the store may be gone already (rank 0 left first): the others then say that


def departed_peers(fit: int, rank: int, world_size: int) -> str | None:
    """What the other ranks that left said, or why we cannot know; None if no one else left a word."""
    store = _store()
    if store is None:
        return None
    said = []
    try:
        for other in range(world_size):
            key = _KEY.format(fit=fit, rank=other)
            if other != rank and store.check([key]):
                said.append(store.get(key).decode())
    except Exception as e:
        if rank != 0:
            return f"the store in global rank 0's process is unreachable ({type(e).__name__}): rank 0 is gone"
        return None
    return "; ".join(said) or None


class PeerLeft(RuntimeError):
    """This rank's step failed because another rank had left training; the message names it."""


def explain_departure(trainer, error: BaseException) -> None:
    """Called as ``trainer.fit()`` unwinds: leaving early, tell the others why; failing because
    another rank left, raise PeerLeft naming it."""
    if isinstance(error, KeyboardInterrupt):
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    others = departed_peers(trainer._fit, rank, world_size) if is_communication_failure(error) else None
    if others is None:
        announce_departure(trainer._fit, rank, trainer.step, error)  # this rank is where it started
    else:
        raise PeerLeft(f"{others}; rank {trainer.rank} was in step {trainer.step + 1} and cannot go on without it "
                       f"(every rank must run every step): {type(error).__name__}: {error}") from error
