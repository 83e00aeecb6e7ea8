"""The straggler line: which rank made the others wait this epoch, and where its time went.

``comm`` on the bar is rank 0's all-reduce wait only; a slow rank shows there as rank 0 waiting,
with nothing naming it. At each epoch's end every rank's ``EpochMeter`` phases (data loading,
compute, all-reduce wait: a few floats) ride in the one all-gather the epoch's loss already needs,
so this costs no extra collective. A rank that waits much less than the others is the one they
wait for: when the others' extra wait exceeds ``threshold`` (10%) of the step *and* stands out of the
step-to-step noise, the line names that rank and the phase where it spent more than they did (data
loading or compute; communication when neither explains the wait, e.g. a slow link). The noise is
measured, not assumed: each rank sends its mean wait per step in ``BLOCKS`` consecutive runs of the
epoch's steps (the same steps on every rank), and the others' extra wait must exceed ``k`` (3) standard
errors of its run-by-run differences. On a shared 2-core machine a rank 12% "slower" in one epoch and 8%
faster in the next is noise, and says nothing (issue 34). With fewer than 3 steps nothing is measured, so
nothing is said; DDP's start-up collectives make the first steps of a run wait inside forward, so a
short first epoch needs a few more steps than that to show a straggler.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

FIELDS = ("loss_sum", "loss_count", "data_s", "compute_s", "comm_s", "step_s", "steps")
BLOCKS = 32  # runs of steps whose mean waits are gathered: enough for a standard error, 256 bytes per rank
_PHASES = {"data_s": "data loading", "compute_s": "compute"}


def gather_epoch(loss_sum: float, loss_count: int, phases: dict[str, float], comm_blocks: list[float],
                 device: torch.device, group: dist.ProcessGroup | None) -> list[dict]:
    """Every rank's loss totals, phases and ``comm_blocks`` (``EpochMeter.comm_blocks(BLOCKS)``), in rank order:
    one all-gather of 7 + BLOCKS float64 per rank, once per epoch."""
    mine = torch.tensor([loss_sum, float(loss_count)] + [phases[k] for k in FIELDS[2:]] + list(comm_blocks),
                        dtype=torch.float64, device=device)  # on the training device: NCCL gathers CUDA tensors only
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks: list[dict] = []
    for t in gathered:
        values = t.tolist()
        rank: dict = dict(zip(FIELDS, values))
        rank["comm_blocks"] = [v for v in values[len(FIELDS):] if not math.isnan(v)]  # NaN: fewer steps than blocks
        ranks.append(rank)
    return ranks


def wait_noise_s(ranks: list[dict], slow: int) -> float | None:
    """The standard error of the others' extra wait per step over ``slow``: the spread of its block-by-block
    differences over the root of their count (None with fewer than 3 blocks: too few to measure any noise)."""
    n = min(len(r["comm_blocks"]) for r in ranks)
    if n < 3:
        return None
    others = [r["comm_blocks"] for i, r in enumerate(ranks) if i != slow]
    diffs = [statistics.median(o[b] for o in others) - ranks[slow]["comm_blocks"][b] for b in range(n)]
    return statistics.stdev(diffs) / math.sqrt(n)


def find_straggler(ranks: list[dict], threshold: float = 0.1, k: float = 3.0) -> dict | None:
    """The rank the others waited for, if their extra wait per step exceeds ``threshold`` of the step and ``k``
    standard errors of its block-to-block noise (``wait_noise_s``); else None.

    ``ranks``: per rank (in rank order) ``data_s``, ``compute_s``, ``comm_s``, ``step_s``, ``steps`` and
    ``comm_blocks`` (``gather_epoch``). Pure: the same answer on every rank from the same gathered numbers.
    """
    if len(ranks) < 2 or any(r["steps"] < 1 for r in ranks):
        return None
    per_step = [{k: r[k] / r["steps"] for k in ("data_s", "compute_s", "comm_s", "step_s")} for r in ranks]
    slow = min(range(len(ranks)), key=lambda i: per_step[i]["comm_s"])  # it waits least: the others wait for it
    others = [p for i, p in enumerate(per_step) if i != slow]
    step_s = statistics.median(p["step_s"] for p in per_step)
    made_wait_s = statistics.median(p["comm_s"] for p in others) - per_step[slow]["comm_s"]
    if step_s <= 0 or made_wait_s <= threshold * step_s:
        return None
    noise_s = wait_noise_s(ranks, slow)
    if noise_s is None or made_wait_s <= k * noise_s:  # not measurably more than chance
        return None
    excess = {k: per_step[slow][k] - statistics.median(p[k] for p in others) for k in _PHASES}
    phase = max(excess, key=excess.__getitem__)
    cause = _PHASES[phase] if excess[phase] >= 0.5 * made_wait_s else "communication"
    return {"rank": slow, "cause": cause, "made_wait_ms": 1e3 * made_wait_s, "wait_share": made_wait_s / step_s,
            "noise_ms": 1e3 * noise_s,
            "own_ms": {k.removesuffix("_s"): 1e3 * per_step[slow][k] for k in ("data_s", "compute_s", "comm_s")},
            "others_ms": {k.removesuffix("_s"): 1e3 * statistics.median(p[k] for p in others)
                          for k in ("data_s", "compute_s", "comm_s")}}


def _ms(value: float) -> str:
    """Milliseconds as the line prints them: a tenth below 10 ms, where whole numbers would read "3 ms; the others
    3 ms" for a rank that did spend 0.6 ms more."""
    return f"{value:.1f}" if value < 9.95 else f"{value:.0f}"


def straggler_line(epoch: int, found: dict) -> str:
    """One line for the progress output, e.g. "epoch 3: straggler rank 1 made the others wait 48 ms per step
    (41% of the step): its time went to data loading (52 ms per step; the others 1 ms)"."""
    head = (f"epoch {epoch}: straggler rank {found['rank']} made the others wait {_ms(found['made_wait_ms'])} ms per "
            f"step ({found['wait_share']:.0%} of the step): ")
    own, others = found["own_ms"], found["others_ms"]
    if found["cause"] == "communication":  # its own phases do not explain the wait: say so with their numbers
        return head + (f"its time went to communication or between steps, not to data loading or compute "
                       f"({_ms(own['data'])} and {_ms(own['compute'])} ms per step; the others "
                       f"{_ms(others['data'])} and {_ms(others['compute'])} ms)")
    key = "data" if found["cause"] == "data loading" else "compute"
    return head + (f"its time went to {found['cause']} ({_ms(own[key])} ms per step; "
                   f"the others {_ms(others[key])} ms)")
