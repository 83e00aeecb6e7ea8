"""Resuming a Trainer checkpoint at another world size: the same global batch, the same samples.

The one idea: what a data-parallel step computes depends on the world size only through
summation order. A step averages the gradient over one global batch, and the global
batch is the next ``global_batch`` positions of the epoch's global order
(DistributedSampler deals that order round-robin). So a checkpoint keeps the *global*
data position, the global batch and the optimizer/scheduler state; at W' ranks the
per-rank micro-batch stays ``batch_size`` and the accumulation steps become
``global_batch / (batch_size * W')``. What cannot carry over is a per-rank RNG whose
rank no longer exists (or does not exist yet): new ranks get a stream derived from
(seed, step, rank), so the resumed run is still a pure function of the checkpoint.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def accum_steps_for(global_batch: int, batch_size: int, world_size: int, where: str) -> int:
    """Micro-batches per optimizer step that make ``global_batch`` at ``world_size``; ValueError if none does."""
    per_step = batch_size * world_size
    if global_batch % per_step:
        raise ValueError(
            f"{where}: global batch {global_batch} cannot be made at world size {world_size} with batch_size="
            f"{batch_size}: it is not a multiple of batch_size x world_size = {per_step} "
            f"(world sizes that can: {', '.join(map(str, _world_sizes(global_batch, batch_size))) or 'none'})"
        )
    return global_batch // per_step


def _world_sizes(global_batch: int, batch_size: int, limit: int = 64) -> list[int]:
    return [w for w in range(1, limit + 1) if global_batch % (batch_size * w) == 0]


def derived_rng_state(seed: int, step: int, rank: int) -> None:
    """Seed this process's torch, numpy and Python RNGs from (seed, step, rank).

    For a rank that has no saved stream (the run grew, or ranks were renumbered): the
    stream differs from what an uninterrupted run would have drawn, but it is fixed by
    the checkpoint, so resuming twice from it gives the same run."""
    mixed = (seed * 1_000_003 + step) * 65_537 + rank  # distinct per (seed, step, rank); no hashing: reproducible
    torch.manual_seed(mixed)
    np.random.seed(mixed % 2**32)
    random.seed(mixed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(mixed)


def global_position(ranks: list[dict], path) -> dict:
    """The sampler state every rank shares: all saved ranks must stand at the same global position."""
    states = [r["sampler"] for r in ranks]
    positions = {s.get("position", s["consumed"] * s.get("num_replicas", len(ranks))) for s in states}
    if len(positions) != 1:
        raise ValueError(f"checkpoint {path}: its ranks saved different data positions {sorted(positions)}; "
                         f"it cannot be resumed at another world size")
    return states[0]


def merge_epoch_loss(ranks: list[dict], rank: int) -> tuple[float, int]:
    """This rank's share of the epoch's running loss: rank 0 takes the old ranks' totals, the others 0,
    so the epoch mean (an all-reduce of sums and counts) is unchanged by the resize."""
    if rank != 0:
        return 0.0, 0
    return sum(r["loss_sum"] for r in ranks), sum(r["loss_count"] for r in ranks)


def batches_done_at(position: int, batches_done: int, batch_size: int, world_size: int, path) -> int:
    """Micro-batches this rank has consumed in the epoch at ``world_size`` for a global ``position``."""
    if batches_done == 0:
        return 0  # at an epoch's start (or the next epoch's, after an end-of-epoch checkpoint)
    per_round = batch_size * world_size
    if position % per_round:
        raise ValueError(f"checkpoint {path}: data position {position} is not a whole number of micro-batches "
                         f"({batch_size} x {world_size} ranks); it cannot be resumed at world size {world_size}")
    return position // per_round


# -- the same for a script's own loop (docs/preemptible.md) ------------------------------------------
def accumulation_steps(global_batch: int, batch_size: int, group=None) -> int:
    """Micro-batches per optimizer step that make ``global_batch`` at this world size.

    Args:
        global_batch: samples per optimizer step over all ranks; keep it fixed across resizes.
        batch_size: samples per micro-batch on each rank (the DataLoader's batch_size).
        group: the process group (default: the default group).

    Raises ValueError naming the value when ``batch_size * world_size`` does not divide it.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    return accum_steps_for(global_batch, batch_size, world_size, "lockstep.accumulation_steps")


def resume(sampler, state: dict, step: int | None = None) -> int:
    """Continue an epoch from a ``DistributedSampler.state_dict()`` saved at any world size.

    The sampler's next iteration yields this rank's share of what is left of the epoch's global
    order; under ``lockstep launch`` the launcher's membership line names ``step``. Returns the
    global data position (samples of the epoch already consumed by all ranks together).
    """
    from lockstep.launch.elastic import report_resume

    sampler.load_state_dict(state)
    saved = state.get("num_replicas")
    report_resume(step, sampler.num_replicas, saved if saved != sampler.num_replicas else None)
    return int(state.get("position", state["consumed"] * (saved or sampler.num_replicas)))
