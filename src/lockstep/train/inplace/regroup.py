"""Re-forming the group: after a failed collective, the survivors agree on the members and on the step.

Each survivor says in the store which step it committed and whether it stood in the next commit (``check_in``); the
first to see every other member either rejoined or silent for ``SILENT_S`` writes the decision (``decide``): the
members who rejoined, and the highest step committed. A survivor one step behind stood in that commit with complete
averages and applies it itself (roll forward); everything after it is discarded (roll back). ``InPlaceGroup.rejoin``
then forms generation g+1. What is not a lost peer is told apart first: a rank stuck in its own code (gloo's timeout
while every member still beats: ``raise_stuck``), a bug in the step (``is_peer_loss``), an error that comes back after
every re-formation (``MAX_REJOINS_WITHOUT_PROGRESS``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch.distributed as dist

from lockstep.diagnostics.watchdog import report_hang_now
from lockstep.keys import INPLACE_TIMEOUT_ENV
from lockstep.train.inplace.outcome import PeerLost

SILENT_S = 1.5  # a member that did not rejoin and whose heartbeat stood still this long is gone
DECIDE_TIMEOUT_S = 60.0
MAX_REJOINS_WITHOUT_PROGRESS = 3  # an error that comes back after every re-formation is no lost peer: raise it
ALARM_SILENT_S = 15.0  # a member silent this long raises the alarm by itself (watcher.py: a cut link closes nothing)


def timed_out(error: BaseException) -> bool:
    """gloo's per-operation timeout ended the collective: "Timed out waiting ...ms for recv operation to complete"
    on the pair that waited, "Application timeout caused pair closure" on others (torch 2.4 - 2.14)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timeout" in text or "timed out" in text)


def is_peer_loss(error: BaseException) -> bool:
    """A collective that failed because of the group (a peer gone, an alarm), not a bug in the step; an error
    raised from one (DiLoCo's ``OuterSyncError`` names the outer all-reduce) is read by its cause."""
    if isinstance(error, (dist.DistError, PeerLost)):
        return True
    text = str(error)
    if isinstance(error, RuntimeError) and ("gloo" in text or "Connection closed" in text
                                            or "Timed out" in text or "Connection reset" in text):
        return True
    return error.__cause__ is not None and is_peer_loss(error.__cause__)


def peers_beat(seen: dict[int, tuple[int, float]], members: list[int], me: int) -> bool:
    """Every other member's heartbeat moved within ``ALARM_SILENT_S``, the watcher's own measure of a silent
    member (not ``SILENT_S``, 1.5 s: on a loaded machine a live member's beat, read every 0.2 s, can stand that
    long). A frozen or cut-off member stops beating, and with the default timeout (60 s) its silence raised the
    alarm first, which shuts the sockets: that collective then fails on a closed connection, not on time."""
    now = time.monotonic()
    return all(now - seen.get(r, (None, -math.inf))[1] <= ALARM_SILENT_S for r in members if r != me)


def raise_stuck(rank: int, timeout_s: float, committed: int, error: BaseException) -> None:
    """gloo's timeout ended a collective and no peer was lost (every member's heartbeat went on, so no alarm
    ended it sooner): a rank is stuck in its own code (a data loader, a debugger, a sleep). Re-forming would
    not mend it: ``decide`` would wait ``DECIDE_TIMEOUT_S`` for it to rejoin or fall silent, then drop one
    rank of a node (gloo's "Timed out waiting" text took that path, its "Application timeout" one raised the
    bare error). The hang watchdog's report names it and where it is, and ends the job (exit 86); without a
    watchdog, this named error."""
    reason = (f"rank {rank} waited {timeout_s:g} s in a collective after step {committed} "
              f"(gloo's timeout in an in-place run: {INPLACE_TIMEOUT_ENV}) while every rank still beats: a rank is "
              "stuck, not lost")
    report_hang_now(reason)
    raise RuntimeError(f"lockstep: in-place recovery: {reason}; in-place recovery re-forms around lost ranks "
                       "only (no hang watchdog ran to say which rank and where: hang_timeout_s)") from error


def check_in(store: dist.Store, key: str, committed: int, ready: int) -> None:
    """Say which step this rank committed and whether it stood in the next commit (``key``: its own, this
    generation's)."""
    store.set(key, json.dumps({"committed": committed, "ready": ready}))


def decide(store: dist.Store, key_of: Callable[[str], str], members: list[int],
           seen: dict[int, tuple[int, float]]) -> dict:
    """The members of the next generation: whoever rejoined, once every other member's heartbeat stood
    still for SILENT_S. The first rank to see that writes it; everyone reads what was written."""
    key, deadline = key_of("decision"), time.monotonic() + DECIDE_TIMEOUT_S
    while not store.check([key]):
        joined = [r for r in members if store.check([key_of(f"joined/{r}")])]
        now = time.monotonic()
        silent = all(now - seen.get(r, (0, now))[1] > SILENT_S for r in members if r not in joined)
        if silent or now > deadline:
            records = [json.loads(store.get(key_of(f"joined/{r}"))) for r in joined]
            decision = {"members": joined, "committed": max(rec["committed"] for rec in records)}
            store.compare_set(key, "", json.dumps(decision))
            break
        time.sleep(0.05)
    return json.loads(store.get(key))


def why_not_go_on(decision: dict, me: int, members: list[int], generation: int, min_world: int, committed: int,
                  ready: int) -> str | None:
    """Why this rank must stop rather than go on with ``decision`` (None: it goes on). The quorum after a store
    move is the caller's (``Stores.quorum``)."""
    if me not in decision["members"]:
        return f"launch rank {me} was judged gone by the others (generation {generation}); it stops"
    if len(decision["members"]) < min_world:  # --nnodes MIN: the agents wait for nodes, as torchrun's do
        return (f"{len(decision['members'])} ranks are left, fewer than --nnodes MIN x --nproc-per-node = "
                f"{min_world}; the workers stop")
    step = decision["committed"]
    if step not in (committed, committed + 1) or (step == committed + 1 and ready != step):
        return f"the survivors committed step {step}, this rank {committed} (ready {ready}): they cannot agree"
    return None
