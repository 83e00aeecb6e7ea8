"""Admitting a node: the newcomers waiting in the store, and rank 0's decision to grow the group with them.

Growing is the step commit read the other way: a node that comes back announces its ranks in the store
(``process_group._join_in_place``) and waits, beating a heart; a survivor whose watcher saw a whole node waiting adds
2 instead of 1 to its next commit, so every rank learns at the same step that the group grows after it; rank 0
admits the newcomers (``grow_decision``, written where each newcomer waits and where the others read it), all form
generation g+1 with them, and the caller hands them rank 0's state over the new group (``Recovery``, train/inplace/
recovery.py; docs/preemptible.md "Growing back in place"). A node is admitted whole: half of a node would change
the world size to one the global batch may not divide.
"""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

from lockstep.keys import INPLACE_JOIN_COUNT_KEY, admit_key, beat_key, join_record_key
from lockstep.train.inplace.outcome import Regrouped
from lockstep.train.inplace.regroup import SILENT_S


class Joins:
    """The newcomers announced in the store (``process_group._join_in_place``), as one rank sees them.

    The watcher thread polls the count (one store read a beat, ``watcher.BEAT_S``); a new record is read once, a
    waiting newcomer's heartbeat each beat. ``ready``: some node's ranks all announced and beat, which this rank's
    next commit says to the others."""

    def __init__(self):
        self.records: dict[int, dict] = {}  # announcement number -> {"id", "node", "local_rank", "local_world"...}
        self.done: set[int] = set()  # ids admitted already
        self.first_beat: dict[int, int] = {}  # id -> its heartbeat's count when this rank first read it
        self.ready = False
        self.lock = threading.Lock()  # the watcher polls while rank 0's main thread admits

    def poll(self, client: dist.Store, now: float, seen: dict[int, tuple[int, float]], members: list[int]) -> None:
        with self.lock:
            count = client.add(INPLACE_JOIN_COUNT_KEY, 0)
            for seq in range(len(self.records) + 1, count + 1):  # announced in order: a gap is one being written
                if not client.check([join_record_key(seq)]):
                    break
                self.records[seq] = json.loads(client.get(join_record_key(seq)))
            waiting = [r["id"] for r in self.records.values() if r["id"] not in self.done and r["id"] not in members]
            for r in waiting:
                beat = client.add(beat_key(r), 0)
                self.first_beat.setdefault(r, beat)
                if seen.get(r, (None,))[0] != beat:
                    seen[r] = (beat, now)
            self.ready = bool(self._complete(now, seen, members))

    def _complete(self, now: float, seen: dict[int, tuple[int, float]], members: list[int]) -> list[dict]:
        nodes: dict[int, list[dict]] = {}
        for r in self.records.values():
            # alive: its heartbeat moved since this rank first read it, lately (a record left by one that died is
            # never admitted)
            beat, when = seen.get(r["id"], (None, -1e18))
            beating = beat != self.first_beat.get(r["id"]) and now - when < SILENT_S
            if r["id"] not in self.done and r["id"] not in members and beating:
                nodes.setdefault(r["node"]["node_rank"], []).append(r)
        whole = [sorted(rs, key=lambda r: r["local_rank"]) for _, rs in sorted(nodes.items())
                 if len({r["local_rank"] for r in rs}) == rs[0]["local_world"]]
        return [r for rs in whole for r in rs]

    def admissible(self, store: dist.Store, seen: dict[int, tuple[int, float]], members: list[int]) -> list[dict]:
        """Rank 0, when the group grows: the newcomers of every whole node, read afresh (another rank may have
        seen them first)."""
        self.poll(store, time.monotonic(), seen, members)
        with self.lock:
            return self._complete(time.monotonic(), seen, members)

    def admitted(self, ids: list[int]) -> None:
        with self.lock:
            self.done.update(ids)
            self.ready = False


def grow_decision(joined: list[dict], members: list[int], where: dict[int, dict], committed: int, generation: int,
                  stores: dict) -> dict:
    """Rank 0's decision to grow by ``joined`` (survivors first, in their order: rank 0 stays rank 0): what every
    member and every newcomer reads. ``stores``: the standby stores and nodes after it (``Stores.with_joined``)."""
    return {"joined": [r["id"] for r in joined], "at": time.time(), "committed": committed,
            "generation": generation + 1, "members": members + [r["id"] for r in joined], "old_world": len(members),
            "where": {**{str(k): v for k, v in where.items()}, **{str(r["id"]): r["node"] for r in joined}},
            "t0": min((r["t0"] for r in joined), default=None), **stores}


def publish(store: dist.Store, key: str, decision: dict) -> None:
    """Rank 0: the decision where each newcomer waits (they make the group with the others' prefix as soon as
    they read it), then where the members read it."""
    for newcomer in decision["joined"]:
        store.set(admit_key(newcomer), json.dumps(decision))
    store.set(key, json.dumps(decision))


def newcomer_outcome(admission: dict, rank: int) -> Regrouped:
    """A newcomer's own admission (``process_group.take_admission``) as the re-formation it takes part in."""
    return Regrouped(admission["generation"], rank, len(admission["members"]), admission["old_world"], [],
                     admission["committed"], False, admission["at"], tuple(admission["joined"]), admission["t0"],
                     newcomer=True)
