"""In-place recovery: when a peer is lost mid-step, the survivors re-form the group in the same processes.

The one idea is the step commit. Every rank enters a one-element all-reduce (the commit) only after its
gradient collectives returned, and applies the optimizer step only after the commit returned. So a commit
that completed on any rank proves every rank's averages completed; a commit that completed nowhere means no
rank changed its parameters. When a collective fails (a peer's sockets closed, or this group's watcher shut
ours because another rank raised the alarm), each survivor says in the store which step it committed and
whether it stood in the next commit; the survivors agree on the members (who rejoined; the others' heartbeats
stopped) and on the step: the highest one committed. A survivor one step behind stood in that commit with
complete averages and applies it itself (roll forward); everything after it is discarded (roll back). Then
the survivors form generation g+1 (a new store prefix, the old group destroyed, its sockets closed), and the
caller re-binds its DDP and re-deals the rest of the epoch at the new size. docs/preemptible.md shows it.

Growing is the same step commit read the other way: a node that comes back announces its ranks in the store
(``process_group._join_in_place``) and waits; a survivor whose watcher saw a whole node waiting adds 2 instead
of 1 to its next commit, so every rank learns at the same step that the group grows after it; rank 0 admits
the newcomers, all form generation g+1 with them, and the caller hands them rank 0's state over the new group
(``broadcast_state``; the Trainer and ``InPlaceRecovery`` do, docs/preemptible.md "Growing back in place").

The store itself may go (node 0's agent serves it): a survivor whose store calls fail moves to the standby store
of the lowest node among the members' nodes but the store's own (every agent serves one; ``_move_store``), claiming
it for its generation, so no two stores serve one generation; the survivors re-form there, and go on only with the
majority rule of ``may_go_on_without_store`` (docs/preemptible.md, "Losing node 0").

Gloo cannot abort an operation in flight (``ProcessGroupGloo.abort()`` and ``shutdown()`` leave a blocked
``wait`` blocked, measured with torch 2.13), so a watcher thread ends it the way a dead peer would: it shuts
down the group's connected TCP sockets, and the blocked operation fails at once. The group's gloo timeout
(``LOCKSTEP_INPLACE_TIMEOUT_S``, 60 s) bounds what neither ends (a cut link with no heartbeat store either).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep import keys
from lockstep.diagnostics.watchdog import report_hang_now
from lockstep.keys import INPLACE_BASE_KEY, INPLACE_ENDED_KEY, INPLACE_PREFIX, INPLACE_TIMEOUT_ENV
from lockstep.network import accepts
from lockstep.process_group import group_sockets, socket_fds, take_admission
from lockstep.train.resize import derived_rng_state

ENV = keys.INPLACE_ENV
TIMEOUT_ENV = INPLACE_TIMEOUT_ENV  # gloo's per-operation timeout in an in-place run
MIN_WORLD_ENV = keys.INPLACE_MIN_WORLD_ENV
PREFIX = INPLACE_PREFIX
REPORT_KEY = keys.INPLACE_REPORT_KEY
BEAT_S = 0.2  # each rank's heartbeat in the store
SILENT_S = 1.5  # a member that did not rejoin and whose heartbeat stood still this long is gone
ALARM_SILENT_S = 15.0  # a member silent this long raises the alarm by itself (a cut link: no socket closes)
DECIDE_TIMEOUT_S = 60.0
MAX_REJOINS_WITHOUT_PROGRESS = 3  # an error that comes back after every re-formation is no lost peer: raise it
STORES_ENV = keys.INPLACE_STORES_ENV
TAKEOVER_KEY = keys.INPLACE_TAKEOVER_KEY
STANDBY_CONNECT_S = 2.0  # a standby store that does not take a connection this fast is not the successor


class PeerLost(RuntimeError):
    """A peer was lost and the survivors re-formed the group: ``outcome`` says how (``Regrouped``)."""

    def __init__(self, outcome: Regrouped):
        super().__init__(f"lost rank(s) {outcome.left}: the group re-formed at world size {outcome.world_size}")
        self.outcome = outcome


@dataclass(frozen=True)
class Regrouped:
    """What the survivors agreed on: the new generation, this rank's place in it, and the step to go on from."""

    generation: int
    rank: int
    world_size: int
    old_world_size: int
    left: list[int]  # the launch ranks that left
    committed: int  # the step every survivor now stands at
    rolled_forward: bool  # this rank applied the agreed step itself (its commit failed after the others')
    alarm_at: float  # wall time of the first alarm (time.time()); of the decision to grow, for a grow
    joined: tuple[int, ...] = ()  # the ids of the newcomers admitted (a grow: ``left`` is empty then)
    joiners_t0: float | None = None  # a grow: wall time the newcomers' launcher started (the earliest)
    newcomer: bool = False  # this process is one of ``joined``: it takes the state from rank 0


def _shut(fds: set[int], keep_port: int) -> None:
    """Shut down the connected sockets among ``fds`` (not a listener: gloo aborts the process on a failed
    accept; not the store's connections on ``keep_port``, a client's or, where this process serves the store,
    the server's): a gloo wait on them fails at once."""
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and keep_port not in (
                    sock.getpeername()[1], sock.getsockname()[1]):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or gone meanwhile
        finally:
            sock.close()


ACCEPTS_JOINS_KEY = keys.INPLACE_ACCEPTS_JOINS_KEY


class Joins:
    """The newcomers announced in the store (``process_group._join_in_place``), as one rank sees them.

    The watcher thread polls the count (one store read a beat, ``BEAT_S``); a new record is read once, a
    waiting newcomer's heartbeat each beat. ``ready``: some node's ranks all announced and beat, which this rank's
    next commit says to the others. A node is admitted whole: half of a node would change the world size to one
    the global batch may not divide."""

    def __init__(self):
        self.records: dict[int, dict] = {}  # announcement number -> {"id", "node", "local_rank", "local_world"...}
        self.done: set[int] = set()  # ids admitted already
        self.first_beat: dict[int, int] = {}  # id -> its heartbeat's count when this rank first read it
        self.ready = False
        self.lock = threading.Lock()  # the watcher polls while rank 0's main thread admits

    def poll(self, client: dist.Store, now: float, seen: dict[int, tuple[int, float]], members: list[int]) -> None:
        with self.lock:
            count = client.add(f"{PREFIX}/join/count", 0)
            for seq in range(len(self.records) + 1, count + 1):  # announced in order: a gap is one being written
                if not client.check([f"{PREFIX}/join/{seq}"]):
                    break
                self.records[seq] = json.loads(client.get(f"{PREFIX}/join/{seq}"))
            waiting = [r["id"] for r in self.records.values() if r["id"] not in self.done and r["id"] not in members]
            for r in waiting:
                beat = client.add(f"{PREFIX}/beat/{r}", 0)
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


def may_go_on_without_store(before: list[int], after: list[int], node_of: dict[int, int],
                            store_node: int | None) -> bool:
    """The split-brain rule, after the store's node stopped answering and the survivors moved to a standby store:
    ``after`` (the ranks that rejoined there) goes on only with more than half of ``before`` (the last
    generation's ranks), or with exactly half where the half gone is ``store_node``'s ranks alone. Two nodes
    cannot tell a cut link from a dead node 0, so one node of two goes on: docs/preemptible.md says what that
    costs; with three or more nodes a side cut off from the majority stops."""
    if 2 * len(after) > len(before):
        return True
    gone = {node_of.get(r) for r in before if r not in after}
    return 2 * len(after) == len(before) and gone == {store_node}


def _stores_from_env(world_size: int) -> tuple[dict[int, tuple[str, int]], dict[int, int], int]:
    """``STORES_ENV``: every node's standby store, the launch ranks on each node, the node serving the store."""
    raw = os.environ.get(STORES_ENV)
    if not raw:
        return {}, {}, 0
    spec = json.loads(raw)
    stores = {int(n["node_rank"]): (n["addr"], int(n["port"])) for n in spec["nodes"]}
    node_of = {int(r): int(n["node_rank"]) for n in spec["nodes"] for r in n["ranks"] if r < world_size}
    return stores, node_of, int(spec["store_node"])


class InPlaceGroup:
    """The default process group of an in-place run, generation by generation.

    Made on every rank right after ``lockstep.init()`` (the Trainer does it under ``lockstep launch --nnodes
    MIN:MAX``). It keeps its own client of the launcher's store (MASTER_ADDR:MASTER_PORT, served by node 0),
    a heartbeat, and the watcher that shuts the group's sockets when any rank raises the alarm.
    """

    def __init__(self, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("InPlaceGroup needs lockstep.init() first")
        admission = take_admission()  # this process joined a running group (a node come back): its place there
        self.me = int(os.environ.get("RANK", dist.get_rank()))  # the launch rank: this process's name for good
        self.members = list(range(dist.get_world_size()))  # launch ranks, in the order of the group's ranks
        self.generation, self.committed, self.ready = 0, 0, 0
        self.joined: Regrouped | None = None  # a newcomer's admission, until the Trainer took the state
        self.where: dict[int, dict] = {}  # newcomer id -> its node ({"node_rank", "addr"}), for the launcher's line
        # node rank -> its standby store (addr, port); launch rank -> node rank; the node serving the store now
        self.stores, self.node_of, self.store_node = _stores_from_env(len(self.members))
        self.next_id = len(self.members)  # the first id no process of this job ever had (newcomers take the next)
        self.accepting = False  # this job admits newcomers (``accept_joins``): said again in a store moved to
        self.moved_at: int | None = None  # the generation whose re-formation moved the store (the quorum rule)
        self.moved_from: int | None = None  # the node that served the store before that move
        if admission is not None:
            self.me, self.members, self.generation = admission["id"], admission["members"], admission["generation"]
            self._learn_stores(admission)
            self.committed = self.ready = admission["committed"]
            self.where = {int(k): v for k, v in admission["where"].items()}
            self.joined = Regrouped(self.generation, self.rank, len(self.members), admission["old_world"], [],
                                    self.committed, False, admission["at"], tuple(admission["joined"]),
                                    admission["t0"], newcomer=True)
        self.joins = Joins()  # newcomers waiting in the store, as this rank's watcher saw them
        self.grow_due = False  # every rank's commit agreed: admit the newcomers after this step
        self.timeout_s = float(timeout_s or os.environ.get(TIMEOUT_ENV) or 60)
        self.backend = dist.get_backend()
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = self._client()
        self.store_moves = 0  # counts the moves to a standby store: the watcher reconnects after one
        self.sockets = group_sockets()
        self._bound_first_group()
        self.lock = threading.Lock()  # held while the group's sockets are shut or the group destroyed
        self.alarm_at: float | None = None
        self.seen: dict[int, tuple[int, float]] = {}  # launch rank -> (its last heartbeat, when it changed)
        self.min_world = int(os.environ.get(MIN_WORLD_ENV) or 1)
        self._rejoins: tuple[int, int] = (-1, 0)  # (committed step, re-formations at it)
        self.stopped = threading.Event()
        self.watcher: threading.Thread | None = None
        self.start()

    def _client(self, host: str | None = None, port: int | None = None,
                connect_s: float = DECIDE_TIMEOUT_S) -> dist.TCPStore:
        host, port = host or self.host, port or self.port
        if connect_s < DECIDE_TIMEOUT_S and not accepts(host, port, connect_s):
            raise ConnectionRefusedError(f"nothing listens at {host}:{port}")  # no TCPStore retries (each logs)
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=connect_s), wait_for_workers=False)
        store.set_timeout(datetime.timedelta(seconds=DECIDE_TIMEOUT_S))
        return store

    def _learn_stores(self, decision: dict) -> None:
        """The standby stores and nodes a grow decision (or a newcomer's admission) carries."""
        self.stores = {int(k): (str(v[0]), int(v[1])) for k, v in decision.get("stores", {}).items()}
        self.node_of = {int(k): int(v) for k, v in decision.get("node_of", {}).items()}
        self.store_node = decision.get("store_node", self.store_node)
        self.next_id = max(self.next_id, int(decision.get("next_id", 0)))

    def _bound_first_group(self) -> None:
        """The group ``init()`` made waits 30 min by default: bound its operations as the next groups' are."""
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            backend.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        except (AttributeError, RuntimeError):
            pass  # another backend, or a torch without it: the socket shutdown still ends a lost peer's waits

    def adopt_sockets(self, fds: set[int]) -> None:
        """Sockets of groups made since (DDP's hierarchical all-reduce makes subgroups): shut with the group's."""
        with self.lock:
            self.sockets |= fds

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def _key(self, what: str, generation: int | None = None) -> str:
        return f"{PREFIX}/{self.generation if generation is None else generation}/{what}"

    # -- the watcher ---------------------------------------------------------------------------
    def _watch(self) -> None:
        client, moves = None, -1  # its own connection: the main thread's may wait in a store call
        while not self.stopped.wait(BEAT_S):
            try:
                if client is None or moves != self.store_moves:  # first, after a failed call, after a move
                    moves, client = self.store_moves, None
                    client = self._client(connect_s=STANDBY_CONNECT_S)
                client.add(f"{PREFIX}/beat/{self.me}", 1)
                now = time.monotonic()
                for r in self.members:
                    beat = client.add(f"{PREFIX}/beat/{r}", 0)
                    if self.seen.get(r, (None,))[0] != beat:
                        self.seen[r] = (beat, now)
                self.joins.poll(client, now, self.seen, self.members)
                generation = self.generation
                if client.check([self._key("alarm", generation)]):
                    self._shut_group(generation)
                elif any(now - t > ALARM_SILENT_S for r, (_, t) in self.seen.items() if r in self.members):
                    self.raise_alarm(client)  # a member froze or its link was cut: nothing else would end our waits
            except Exception:  # the store is slow or gone: the gloo timeout still bounds the step
                client = None  # a TCPStore client whose server went away never reconnects by itself
                continue

    def _shut_group(self, generation: int) -> None:
        with self.lock:
            if generation == self.generation and self.sockets:
                _shut(self.sockets, self.port)
                self.sockets = set()

    def raise_alarm(self, client: dist.Store | None = None) -> None:
        """Tell every rank of this generation to drop its collectives and rejoin (first caller's time kept)."""
        (client or self.store).compare_set(self._key("alarm"), "", f"{time.time():.3f}")

    def start(self) -> None:
        """Heartbeat and watch (again, after ``stop``: a Trainer's second ``fit``)."""
        if self.watcher is None or not self.watcher.is_alive():
            self.stopped.clear()
            self.watcher = threading.Thread(target=self._watch, name="lockstep-inplace", daemon=True)
            self.watcher.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.watcher is not None:
            self.watcher.join(timeout=2 * BEAT_S + 1)

    # -- the commit ----------------------------------------------------------------------------
    def commit(self, step: int) -> Regrouped | None:
        """Every rank's averages for ``step`` completed: apply it. None: as usual. A ``Regrouped``: a peer was
        lost during the commit and the others had completed it: apply it too (this rank's averages are complete),
        then go on at the new size. Raises ``PeerLost`` when the step is discarded."""
        self.ready = step
        # 1, or 2 where this rank's watcher saw newcomers waiting: the sum exceeds the world size on every rank
        # alike, so all agree on the step after which the group grows (``grow``), at no extra collective and
        # in the same one element (exact in float32 for any world size below 2**23)
        flag = torch.tensor([1.0 + float(self.joins.ready)])
        try:
            dist.all_reduce(flag)
        except Exception as e:
            outcome = self.rejoin(e)
            if outcome.committed != step:
                raise PeerLost(outcome) from e
            return outcome
        self.committed = step
        self.grow_due = flag.item() > len(self.members)
        return None

    # -- growing ------------------------------------------------------------------------------
    def grow(self) -> Regrouped | None:
        """After the step whose commit said newcomers wait, on every rank: rank 0 admits every node whose ranks
        all announced themselves and still beat, and all form the next generation with them (survivors first, in
        their order: rank 0 stays rank 0). None when nobody was admitted (the newcomers fell silent)."""
        self.grow_due = False
        key = self._key("grow")
        if self.rank == 0:
            joined = self.joins.admissible(self.store, self.seen, self.members)
            members = self.members + [r["id"] for r in joined]
            decision = {"joined": [r["id"] for r in joined], "at": time.time(), "committed": self.committed,
                        "generation": self.generation + 1, "members": members, "old_world": len(self.members),
                        "where": {**{str(k): v for k, v in self.where.items()},
                                  **{str(r["id"]): r["node"] for r in joined}},
                        "t0": min((r["t0"] for r in joined), default=None), **self._stores_with(joined)}
            for r in joined:  # the newcomers make the group with the others' prefix as soon as they read this
                self.store.set(f"{PREFIX}/admit/{r['id']}", json.dumps(decision))
            self.store.set(key, json.dumps(decision))
        decision = json.loads(self.store.get(key))
        self.joins.admitted(decision["joined"])
        if not decision["joined"]:
            return None
        self._learn_stores(decision)
        old_world = len(self.members)
        self.where = {int(k): v for k, v in decision["where"].items()}
        self._next_group(decision["members"])
        return Regrouped(self.generation, self.rank, len(self.members), old_world, [], self.committed, False,
                         decision["at"], tuple(decision["joined"]), decision["t0"])

    def _stores_with(self, joined: list[dict]) -> dict:
        """The standby stores and nodes after admitting ``joined`` (a returning node's agent serves a new one)."""
        stores = {str(k): list(v) for k, v in self.stores.items()}
        stores.update({str(r["node"]["node_rank"]): [r["node"]["addr"], r["node"]["standby"]]
                       for r in joined if "standby" in r["node"]})
        node_of = {**{str(k): v for k, v in self.node_of.items()},
                   **{str(r["id"]): r["node"]["node_rank"] for r in joined}}
        next_id = max([self.next_id, *(r["id"] + 1 for r in joined)])
        return {"stores": stores, "node_of": node_of, "store_node": self.store_node, "next_id": next_id}

    # -- rejoining -----------------------------------------------------------------------------
    def _peers_beat(self) -> bool:
        """Every other member's heartbeat moved within ``ALARM_SILENT_S``, the watcher's own measure of a silent
        member (not ``SILENT_S``, 1.5 s: on a loaded machine a live member's beat, read every 0.2 s, can stand that
        long). A frozen or cut-off member stops beating, and with the default timeout (60 s) its silence raised the
        alarm first, which shuts the sockets: that collective then fails on a closed connection, not on time."""
        now = time.monotonic()
        return all(now - self.seen.get(r, (None, -math.inf))[1] <= ALARM_SILENT_S
                   for r in self.members if r != self.me)

    def _stuck(self, error: BaseException) -> None:
        """gloo's timeout ended a collective and no peer was lost (every member's heartbeat went on, so no alarm
        ended it sooner): a rank is stuck in its own code (a data loader, a debugger, a sleep). Re-forming would
        not mend it: ``_decide`` would wait ``DECIDE_TIMEOUT_S`` for it to rejoin or fall silent, then drop one
        rank of a node (gloo's "Timed out waiting" text took that path, its "Application timeout" one raised the
        bare error). The hang watchdog's report names it and where it is, and ends the job (exit 86); without a
        watchdog, this named error."""
        reason = (f"rank {self.rank} waited {self.timeout_s:g} s in a collective after step {self.committed} "
                  f"(gloo's timeout in an in-place run: {TIMEOUT_ENV}) while every rank still beats: a rank is stuck, "
                  "not lost")
        report_hang_now(reason)
        raise RuntimeError(f"lockstep: in-place recovery: {reason}; in-place recovery re-forms around lost ranks "
                           "only (no hang watchdog ran to say which rank and where: hang_timeout_s)") from error

    def is_peer_loss(self, error: BaseException) -> bool:
        """A collective that failed because of the group (a peer gone, an alarm), not a bug in the step."""
        if isinstance(error, (dist.DistError, PeerLost)):
            return True
        text = str(error)
        return isinstance(error, RuntimeError) and ("gloo" in text or "Connection closed" in text
                                                    or "Timed out" in text or "Connection reset" in text)

    def rejoin(self, error: BaseException) -> Regrouped:
        """After a failed collective: agree with the survivors on members and step, and form the next group."""
        if _timed_out(error) and self._peers_beat():
            self._stuck(error)  # raises: a rank is stuck, not lost
        if not self.is_peer_loss(error):
            raise error
        step, count = self._rejoins
        self._rejoins = (self.committed, count + 1 if step == self.committed else 1)
        if self._rejoins[1] > MAX_REJOINS_WITHOUT_PROGRESS:
            raise RuntimeError(f"lockstep: in-place recovery: re-formed {MAX_REJOINS_WITHOUT_PROGRESS} times at step "
                               f"{self.committed} without a step done; the error is not a lost peer") from error
        self._shut_group(self.generation)  # our pending operations end now, not at the gloo timeout
        try:
            self._check_in()
        except Exception as store_error:  # the store's node is gone: move to the successor's standby store
            if not self._move_store():
                raise RuntimeError(f"lockstep: in-place recovery: the workers' store at {self.host}:{self.port} "
                                   f"stopped answering ({store_error}) and no other node's standby store "
                                   "answered") from error
            self._check_in()
        decision = self._decide()
        if not self._quorum(decision["members"]):
            raise RuntimeError(f"lockstep: in-place recovery: node {self.moved_from}, which served the workers' "
                               f"store, is gone and {len(decision['members'])} of {len(self.members)} ranks are left: "
                               "not a majority, so this side stops (a cut link would otherwise leave two jobs "
                               "training; docs/preemptible.md)") from error
        if self.me not in decision["members"]:
            raise RuntimeError(f"lockstep: in-place recovery: launch rank {self.me} was judged gone by the others "
                               f"(generation {self.generation}); it stops") from error
        if len(decision["members"]) < self.min_world:  # --nnodes MIN: the agents wait for nodes, as torchrun's do
            raise RuntimeError(f"lockstep: in-place recovery: {len(decision['members'])} ranks are left, fewer than "
                               f"--nnodes MIN x --nproc-per-node = {self.min_world}; the workers stop") from error
        step = decision["committed"]
        if step not in (self.committed, self.committed + 1) or (step == self.committed + 1 and self.ready != step):
            raise RuntimeError(f"lockstep: in-place recovery: the survivors committed step {step}, this rank "
                               f"{self.committed} (ready {self.ready}): they cannot agree") from error
        alarm_at = float(self.store.get(self._key("alarm")).decode())
        old_world, left = len(self.members), sorted(set(self.members) - set(decision["members"]))
        self._next_group(decision["members"])
        rolled_forward = step != self.committed
        self.committed = self.ready = step
        return Regrouped(self.generation, self.rank, len(self.members), old_world, left, step, rolled_forward,
                         alarm_at)

    def _check_in(self) -> None:
        """Raise the alarm and say which step this rank committed and whether it stood in the next commit."""
        self.raise_alarm()
        mine = {"committed": self.committed, "ready": self.ready}
        self.store.set(self._key(f"joined/{self.me}"), json.dumps(mine))

    def _move_store(self) -> bool:
        """The workers' store stopped answering: move to the standby store of the lowest node rank among the
        members' nodes but the store's own; every survivor computes the same list and takes the first that
        answers. The generation fences it: a store that took over for another generation is not used for this
        one. False where none answered (or this run has no standby stores: not under ``lockstep launch``)."""
        nodes = sorted({self.node_of[m] for m in self.members if m in self.node_of} - {self.store_node})
        claim = json.dumps({"generation": self.generation, "from": self.store_node})
        for node in nodes:
            if node not in self.stores:
                continue
            addr, port = self.stores[node]
            try:
                store = self._client(addr, port, connect_s=STANDBY_CONNECT_S)
                if store.compare_set(TAKEOVER_KEY, "", claim).decode() != claim:
                    continue  # it serves another generation: never two stores for one generation
                store.compare_set(INPLACE_BASE_KEY, "", str(self.next_id))  # newcomers' ids go on from here
                if self.accepting:
                    store.set(ACCEPTS_JOINS_KEY, "1")
            except Exception:  # its node is gone too
                continue
            with self.lock:
                self.moved_from, self.moved_at = self.store_node, self.generation
                self.host, self.port, self.store_node, self.store = addr, port, node, store
                now = time.monotonic()  # judge silence from here: every heartbeat so far went to the old store
                self.seen = dict.fromkeys(self.members, (-1, now))
                self.joins = Joins()  # the announcements start again in this store
                self.store_moves += 1
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
            return True
        return False

    def _quorum(self, members: list[int]) -> bool:
        if self.moved_at != self.generation:
            return True  # the store stayed: whoever it saw rejoin goes on (item 1's rule)
        return may_go_on_without_store(self.members, members, self.node_of, self.moved_from)

    def _decide(self) -> dict:
        """The members of the next generation: whoever rejoined, once every other member's heartbeat stood
        still for SILENT_S. The first rank to see that writes it; everyone reads what was written."""
        key, deadline = self._key("decision"), time.monotonic() + DECIDE_TIMEOUT_S
        while not self.store.check([key]):
            joined = [r for r in self.members if self.store.check([self._key(f"joined/{r}")])]
            now = time.monotonic()
            silent = all(now - self.seen.get(r, (0, now))[1] > SILENT_S for r in self.members if r not in joined)
            if silent or now > deadline:
                records = [json.loads(self.store.get(self._key(f"joined/{r}"))) for r in joined]
                decision = {"members": joined, "committed": max(rec["committed"] for rec in records)}
                self.store.compare_set(key, "", json.dumps(decision))
                break
            time.sleep(0.05)
        return json.loads(self.store.get(key))

    def _next_group(self, members: list[int]) -> None:
        with self.lock:  # the watcher must not shut sockets that the next group may reuse
            self.sockets = set()
            dist.destroy_process_group()
            self.generation += 1
            self.members = members
        before = socket_fds()
        store = dist.PrefixStore(self._key("pg"), self.store)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=len(members),
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        with self.lock:
            self.sockets = socket_fds() - before
        # what a reader of the environment sees (report_resume, hang reports) follows the new group
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(self.rank), str(len(members))

    def finish(self, step: int) -> None:
        """Training ended (the last step, or a stop): rank 0 says so in the store, so that a newcomer still waiting to
        be admitted, or one whose launcher joins now, leaves in one line with exit 0 (process_group.py) instead of
        waiting for a job that is gone. The job keeps saying it admits newcomers: a launcher sent down torch's way
        instead would form a round of its own against the ending job's stale records."""
        if self.rank == 0:
            try:
                self.store.set(INPLACE_ENDED_KEY, json.dumps({"step": step}))
            except Exception:  # a notice only: the store's node may be going with the job
                pass

    def accept_joins(self) -> None:
        """Say in the store that this job admits newcomers at its step boundaries (the Trainer and InPlaceRecovery
        do): only then does a returning node's launcher join in place (launch/rendezvous.py); otherwise it takes the
        restart path. Called on every rank: rank 0 writes it; any survivor says it again in a store moved to."""
        self.accepting = True
        if self.rank == 0:
            self.store.set(ACCEPTS_JOINS_KEY, "1")

    def settle(self) -> None:
        """After the caller re-bound its model to the new group: let the old group's works, and with them its
        sockets and threads, go now (the graveyard keeps works 5 s: ``lockstep.ddp.lifetime``)."""
        import gc

        from lockstep.ddp.lifetime import let_go_of_finished

        gc.collect()  # the old reducer lives in a reference cycle (its hooks point back at it)
        let_go_of_finished()

    def report(self, outcome: Regrouped, step: int) -> None:
        """Rank 0 of the new group, after its first step at the new size: the launcher's line
        (``node 1 (10.201.0.2) left at step 812: world 4 -> 2 in 1.8 s, 0 steps lost``)."""
        if self.rank != 0:
            return
        now = time.time()
        record = {"left": outcome.left, "old_world": outcome.old_world_size, "world": outcome.world_size,
                  "step": outcome.committed, "seconds": now - outcome.alarm_at, "lost": 0,
                  "first_step": step, "joined": list(outcome.joined),
                  "where": {str(k): v for k, v in self.where.items()}}
        if outcome.joined:  # from the newcomers' launcher start; and what the grow cost the others
            record["seconds"], record["paused"] = now - (outcome.joiners_t0 or now), now - outcome.alarm_at
        self.store.set(f"{REPORT_KEY}/{outcome.generation}", json.dumps(record))
        self.store.set(f"{REPORT_KEY}/latest", str(outcome.generation))  # where a launcher that joined starts


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a state sent by ``broadcast_state``: its index in the flat buffer of its dtype."""

    dtype: str
    offset: int
    shape: tuple[int, ...]


def hand_over(group: InPlaceGroup, outcome: Regrouped, live_state: Callable[[], dict],
              adopt: Callable[[dict], None], resize: Callable[[Regrouped], None], seed: int,
              step: Callable[[], int]) -> None:
    """Every rank of a grown group (the survivors at the step boundary, the newcomers at their start; the Trainer
    and ``InPlaceRecovery`` alike): the same collectives in the same order. Rank 0's ``live_state()`` reaches every
    rank (``broadcast_state``); the newcomers ``adopt`` it; all ``resize`` to the new group; a newcomer's RNG is
    then derived from (``seed``, the adopted ``step()``, its rank), as a resume at the larger size gives a rank that
    did not exist (train/resize.py)."""
    state = broadcast_state(live_state() if dist.get_rank() == 0 else None)
    assert isinstance(state, dict)
    if outcome.newcomer:
        adopt(state)  # its replicas now equal rank 0's; rebind's check at the first forward says so
    resize(outcome)
    if outcome.newcomer:
        group.joined = None
        derived_rng_state(seed, step(), outcome.rank)


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


def wanted() -> bool:
    """In-place recovery is on for this process (``lockstep launch --nnodes MIN:MAX``, or LOCKSTEP_INPLACE=1).

    gloo only: what ends a lost peer's waits here (shutting the group's TCP sockets) is gloo's; NCCL runs keep
    the restart path (an NCCL communicator would need its own abort, untested here). At any world size, one rank
    included: a job that started with one node of one rank grows in place when a second machine comes (until
    2026-11-26 it took the restart path, from its last checkpoint)."""
    return os.environ.get(ENV) == "1" and dist.is_initialized() and dist.get_backend() == "gloo"


def _timed_out(error: BaseException) -> bool:
    """gloo's per-operation timeout ended the collective: "Timed out waiting ...ms for recv operation to complete"
    on the pair that waited, "Application timeout caused pair closure" on others (torch 2.4 - 2.14)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timeout" in text or "timed out" in text)


class PeersJoined(PeerLost):
    """Nodes came back and joined at a step boundary: the group grew (``outcome.joined``) and the newcomers hold
    this job's state. A ``PeerLost``, so a loop that catches that iterates the loader again, at the new size."""

    def __init__(self, outcome: Regrouped):
        RuntimeError.__init__(self, f"rank(s) {list(outcome.joined)} joined: the group re-formed at world size "
                                    f"{outcome.world_size}")
        self.outcome = outcome


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
        self.step_count = 0
        self._sampler_state = sampler.state_dict()  # the position the last committed step left
        self._report: Regrouped | None = None
        self._handed: dict | None = None  # a newcomer: the job's sampler state, until ``set_epoch`` reaches its epoch
        self._rolled_forward: Regrouped | None = None  # a re-formation after an applied step: raised at the next step
        self.group.accept_joins()  # a node that comes back joins at a step boundary (launch/rendezvous.py)
        if self.group.joined is not None:  # this process is such a node: the others wait in ``_take_over`` now
            self._take_over(self.group.joined)

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
        if self.group.grow_due:  # the last step's commit said nodes wait: admit them before this epoch's first batch
            self._grow()
        return True

    def step(self, fn: Callable[[], object]) -> object:
        if self._rolled_forward is not None:  # the last step was applied and the group re-formed meanwhile
            applied, self._rolled_forward = self._rolled_forward, None
            raise PeerLost(applied)  # this batch was dealt at the old layout: iterate the loader again
        if self.group.grow_due:  # the last step's commit said nodes wait: admit them at this boundary, before fn
            outcome = self._grow()
            if outcome is not None:
                raise PeersJoined(outcome)  # this batch was dealt at the old size: iterate the loader again
        try:
            result = fn()
            regrouped = self.group.commit(self.step_count + 1)
        except PeerLost as lost:
            self._regrouped(lost.outcome, rolled_back=True)
            raise
        except Exception as e:
            outcome = self.group.rejoin(e)  # re-raises what is no peer loss
            self._regrouped(outcome, rolled_back=True)
            raise PeerLost(outcome) from e
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self._sampler_state = self.sampler.state_dict()
        if self._report is not None:
            self.group.report(self._report, self.step_count)
            self._report = None
        if regrouped is not None:
            # This rank applied the step the others had committed (roll forward). It returns as they did, so that
            # the script's code after step() (its scheduler.step(), its counters) runs for this step here too; the
            # next step() raises PeerLost before its fn. Raising now skipped that code on this rank alone: its LR
            # schedule fell one step behind the others'.
            self._regrouped(regrouped, rolled_back=False)
            self._rolled_forward = regrouped
        return result

    def _grow(self) -> Regrouped | None:
        """Every rank, at the boundary after the commit that said nodes wait: admit them (``InPlaceGroup.grow``) and
        hand them the state. None when nobody was admitted (the newcomers fell silent)."""
        outcome = self.group.grow()
        if outcome is not None:
            self._take_over(outcome)
        return outcome

    def _take_over(self, outcome: Regrouped) -> None:
        """``hand_over``, the survivors at the boundary and the newcomers in the constructor: all re-bind and
        re-deal at the new size."""
        hand_over(self.group, outcome, self._live_state, self._adopt,
                  lambda regrouped: self._regrouped(regrouped, rolled_back=False), self.sampler.seed,
                  lambda: self.step_count)

    def _live_state(self) -> dict:
        """What a newcomer needs to take the next step as if it had trained all along (rank 0's): no tensor is
        copied here, ``broadcast_state`` flattens them."""
        return {"model": self.ddp.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "sampler": self._sampler_state, "step": self.step_count}

    def _adopt(self, state: dict) -> None:
        self.ddp.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]
        self._sampler_state = self._handed = state["sampler"]

    def _regrouped(self, outcome: Regrouped, rolled_back: bool) -> None:
        if rolled_back:
            self.optimizer.zero_grad(set_to_none=True)
        self.ddp.rebind(None)
        self.group.settle()
        self.sampler.num_replicas, self.sampler.rank = outcome.world_size, outcome.rank
        self.sampler.load_state_dict(self._sampler_state)
        self._report = outcome


def _epoch_done(sampler, epoch: int) -> dict:
    """A sampler state at the end of ``epoch`` (its next iteration yields nothing), at the sampler's world size."""
    n, replicas = len(sampler.dataset), sampler.num_replicas
    return {**sampler.state_dict(consumed=0), "epoch": epoch, "position": n, "consumed": n // replicas}

