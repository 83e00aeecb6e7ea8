"""The text of a hang report: where every rank is, which ranks the others wait for, one line of diagnosis.

Pure functions of the records the watchdogs exchanged (``lockstep.diagnostics.watchdog``): a record is
a progress snapshot (``progress.Progress.snapshot``) plus, for ranks that answered the alarm, ``where``
(the innermost line of the user's code), ``collective`` (a ``torch.distributed`` call the training
thread is inside) and ``stacks`` (faulthandler's dump of every thread). Steps are numbered from 1:
step n is the n-th synchronised backward.
"""

from __future__ import annotations

import time
from typing import Any

_RULE = "=" * 100
DDP_STEP = ("forward", "loss", "backward", "wait", "outer")
HANG_EXIT_CODE = 86  # every rank leaves with it once the hang report is written


def _step(rec: dict[str, Any]) -> int:
    return rec["step_done"] + 1


def describe(rec: dict[str, Any]) -> str:
    """``all-reduce of bucket 3 (collective #41) of step 12``, ``data loading before step 12``..."""
    n, phase = _step(rec), rec["phase"]
    if phase == "outer" and rec.get("outer"):
        return _outer(rec["outer"])
    if phase == "wait":  # ZeRO-2's all-gathers are of the last step's update, waited for in this step's forward
        op = rec.get("op", "all-reduce")
        step = f"the update of step {n - 1}" if op == "all-gather" else f"step {n}"
        return f"{op} of bucket {rec['bucket']} (collective #{rec['seq']}) of {step}"
    if phase == "backward":
        launched = f", bucket {rec['bucket']} launched last" if rec["bucket"] >= 0 else ""
        return f"backward of step {n}{launched}"
    if phase == "forward":
        return f"forward of step {n}"
    if phase == "loss":
        return f"between forward and backward of step {n}"
    if phase == "data":
        return f"data loading before step {n}"
    return f"{phase} after step {n - 1}"


def _outer(o: dict[str, Any]) -> str:
    """``DiLoCo's outer all-reduce of fragment 0, bucket 2 of 4 (launched after inner step 8, waited for after 9)``."""
    what = "outer all-reduce" if o["op"] == "all-reduce" else "broadcast inside the node of the outer all-reduce"
    return (f"DiLoCo's {what} of fragment {o['fragment']}, bucket {o['bucket']} of {o['buckets']} "
            f"(launched after inner step {o['launched_at']}, waited for after inner step {o['inner_step']})")


def _doing(rec: dict[str, Any]) -> str:
    """``in data loading at train.py:57 in main`` / ``in torch.distributed.barrier at train.py:80 in main``."""
    where = rec.get("where", "?")
    if rec.get("collective"):
        return f"in torch.distributed.{rec['collective']} at {where}"
    what = {"data": "data loading", "loss": "the loss, before backward",
            "wait": "the next forward" if rec.get("op") == "all-gather" else "the end of backward",
            "backward": "backward", "forward": "forward",
            "outer": "DiLoCo's outer sync"}.get(rec["phase"], rec["phase"])
    return f"in {what} at {where}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _is_waiting(rec: dict[str, Any]) -> bool:
    return rec["phase"] in ("wait", "outer", "backward", "forward")


def diagnose(infos: dict[int, Any], records: dict[int, Any], world_size: int) -> str:
    """One line: which ranks the others wait for and where they are, then where the others wait.

    ``infos``: the ranks that answered the alarm (with location); ``records``: every rank's last published
    progress (a rank missing from ``infos`` did not answer: it is dead or frozen).
    """
    silent = [r for r in range(world_size) if r not in infos]
    waiting = {r: i for r, i in infos.items() if i["phase"] in ("wait", "outer")} or {
        r: i for r, i in infos.items() if _is_waiting(i)
    }
    if not waiting:
        return "no rank is inside a DDP step: " + "; ".join(
            f"rank {r} is {_doing(i)}" for r, i in sorted(infos.items())
        )
    # The collective the furthest waiters are stuck in: every rank behind it is one they wait for.
    # DiLoCo: a node's rank that waits for its own bucket's all-reduce before the one waiting for its broadcast
    front = max(waiting.values(), key=lambda i: (_step(i), i["seq"] if i["phase"] == "wait" else -1,
                                                 (i.get("outer") or {}).get("op") == "all-reduce"))
    at_front = sorted(r for r, i in waiting.items() if describe(i) == describe(front))
    parts = []
    for r in silent:
        rec = records.get(r)
        if rec and rec.get("exited"):
            parts.append(_gone(r, rec))
            continue
        last = f"last seen in {describe(rec)}" if rec else "never published progress"
        parts.append(f"rank {r} does not respond ({last}): it died or is frozen")
    for r, i in sorted(infos.items()):
        if r in at_front:
            continue
        n = _step(front)
        if front["phase"] == "outer" and _step(i) == n and i["phase"] not in DDP_STEP:
            # DiLoCo syncs between steps: a peer at the same step count has not reached the sync yet
            parts.append(f"rank {r} has not reached DiLoCo's outer sync after inner step {n - 1} ({_doing(i)})")
        elif front["phase"] == "outer" and i["phase"] == "outer":  # a node's rank waits for its sender's bucket
            parts.append(f"rank {r} waits in {describe(i)}")
        elif _step(i) < n:
            parts.append(f"rank {r} is {n - _step(i)} step(s) behind, in {describe(i)} ({_doing(i)})")
        elif _step(i) == n and i["phase"] not in ("forward", "loss", "backward", "wait"):
            parts.append(f"rank {r} has not started forward of step {n} ({_doing(i)})")
        elif _step(i) == n and i["phase"] == "forward":
            parts.append(f"rank {r} has not finished forward of step {n} ({_doing(i)})")
        elif _step(i) == n and i["phase"] == "loss":
            parts.append(f"rank {r} has not started backward of step {n} ({_doing(i)})")
        elif _step(i) == n and i["phase"] in ("backward", "wait"):
            parts.append(f"rank {r} is in {describe(i)} instead: the ranks' collectives differ ({_doing(i)})")
        else:
            parts.append(f"rank {r} is past step {n}, in {describe(i)} ({_doing(i)})")
        if i.get("skipped_backward"):
            step, where = i["skipped_backward"]
            parts[-1] += (
                f"; it skipped a backward: its forward of step {step} was followed by another forward at {where}"
            )
    waits = f"{_ranks(at_front)} wait{'s' if len(at_front) == 1 else ''} in {describe(front)}"
    if not parts:
        return (
            f"every rank waits in {describe(front)}: no rank is behind "
            "(a collective issued on a group or device they do not share?)"
        )
    return "; ".join(parts) + "; " + waits


def _table(infos: dict[int, Any], records: dict[int, Any], world_size: int) -> list[str]:
    lines = [f"{'rank':>4}  {'position':<58} {'for':>8}  where"]
    now = time.time()
    for r in range(world_size):
        if r in infos:
            i = infos[r]
            lines.append(f"{r:>4}  {describe(i):<58} {i['stalled_s']:>7.1f}s  {_doing(i)[3:]}")
        elif r in records:
            rec = records[r]
            lines.append(
                f"{r:>4}  {describe(rec):<58} {'?':>8}  no answer; last heartbeat {now - rec['wall']:.1f} s ago"
            )
        else:
            lines.append(f"{r:>4}  {'(no progress published)':<58}")
    return lines


def hang_report(alarm: dict[str, Any], infos: dict[int, Any], records: dict[int, Any], world_size: int,
                hang_timeout_s: float) -> str:
    lines = [_RULE, f"lockstep hang report: {alarm['reason']}",
             f"diagnosis: {diagnose(infos, records, world_size)}", "", *_table(infos, records, world_size), ""]
    for r in sorted(infos):
        lines += [
            f"--- rank {r}: Python stacks of every thread (most recent call first) ---",
            infos[r]["stacks"].rstrip(),
            "",
        ]
    lines += [f"The job is ended (exit code {HANG_EXIT_CODE}) instead of waiting for the process group's timeout; "
              f"hang_timeout_s={hang_timeout_s:g} (DistributedDataParallel(hang_timeout_s=...), "
              "lockstep launch --hang-timeout, $LOCKSTEP_HANG_TIMEOUT_S; 0 turns it off).", _RULE]
    return "\n".join(lines)


def _gone(r: int, rec: dict[str, Any]) -> str:
    """What became of a peer that stopped beating: its last record says whether it exited, and on what."""
    if rec.get("exited"):
        if rec.get("error"):
            return f"rank {r} exited on an error of its own ({rec['error']}) in {describe(rec)}"
        return f"rank {r} exited without an error after {describe(rec)}"
    return f"rank {r} stopped responding (its last heartbeat showed {describe(rec)}): it died or is frozen"


def failure_report(rank: int, info: dict[str, Any], records: dict[int, Any], silent: list[int], world_size: int) -> str:
    """A rank left a DDP step with an error (a collective failed) while ``silent`` ranks stopped beating or exited."""
    gone = "; ".join(_gone(r, records[r]) for r in silent)
    lines = [_RULE, f"lockstep failure report (rank {rank}): {gone}; "
             f"rank {rank} failed in {describe(info)} ({_doing(info)})", "",
             *_table({rank: info}, records, world_size), "",
             f"--- rank {rank}: the error that ended its step ---", info["stacks"].rstrip(), _RULE]
    return "\n".join(lines)
