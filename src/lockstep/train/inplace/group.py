"""The in-place group, generation by generation, and its step commit.

The one idea is the step commit. Every rank enters a one-element all-reduce (the commit) only after its
gradient collectives returned, and applies the optimizer step only after the commit returned. So a commit
that completed on any rank proves every rank's averages completed; a commit that completed nowhere means no
rank changed its parameters. When a collective fails (a peer's sockets closed, or the watcher shut ours because
another rank raised the alarm), the survivors agree on the members and the step (regroup.py), moving to a
standby store first where the store's node went with the peer (store_move.py), and form generation g+1: a new
store prefix, the old group destroyed, its sockets closed. Nodes that come back are admitted at a step boundary
the commit agreed on (admission.py). ``InPlaceGroup`` holds what each of those changes: the members, the
generation, the step committed.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import threading
import time

import torch
import torch.distributed as dist

from lockstep.keys import (
    INPLACE_ACCEPTS_JOINS_KEY,
    INPLACE_ENDED_KEY,
    INPLACE_ENV,
    INPLACE_MIN_WORLD_ENV,
    INPLACE_REPORT_KEY,
    INPLACE_TIMEOUT_ENV,
    generation_key,
)
from lockstep.process_group import group_sockets, socket_fds, take_admission
from lockstep.train.inplace import admission, regroup
from lockstep.train.inplace.admission import Joins
from lockstep.train.inplace.outcome import PeerLost, Regrouped
from lockstep.train.inplace.store_move import STANDBY_CONNECT_S, Stores, connect
from lockstep.train.inplace.watcher import Watcher, shut_sockets


class InPlaceGroup:
    """The default process group of an in-place run, generation by generation.

    Made on every rank right after ``lockstep.init()`` (the Trainer does it under ``lockstep launch --nnodes
    MIN:MAX``). It keeps its own client of the launcher's store (MASTER_ADDR:MASTER_PORT, served by node 0;
    ``stores``), a heartbeat, and the watcher that shuts the group's sockets when any rank raises the alarm.
    """

    def __init__(self, timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("InPlaceGroup needs lockstep.init() first")
        admitted = take_admission()  # this process joined a running group (a node come back): its place there
        self.me = int(os.environ.get("RANK", dist.get_rank()))  # the launch rank: this process's name for good
        self.members = list(range(dist.get_world_size()))  # launch ranks, in the order of the group's ranks
        self.generation, self.committed, self.ready = 0, 0, 0
        self.joined: Regrouped | None = None  # a newcomer's admission, until its caller took the state
        self.where: dict[int, dict] = {}  # newcomer id -> its node ({"node_rank", "addr"}), for the launcher's line
        self.stores = Stores(len(self.members))  # the workers' store, and the standby stores it may move to
        if admitted is not None:
            self.me, self.members, self.generation = admitted["id"], admitted["members"], admitted["generation"]
            self.stores.learn(admitted)
            self.committed = self.ready = admitted["committed"]
            self.where = {int(k): v for k, v in admitted["where"].items()}
            self.joined = admission.newcomer_outcome(admitted, self.rank)
        self.accepting = False  # this job admits newcomers (``accept_joins``): said again in a store moved to
        self.joins = Joins()  # newcomers waiting in the store, as this rank's watcher saw them
        self.grow_due = False  # every rank's commit agreed: admit the newcomers after this step
        self.timeout_s = float(timeout_s or os.environ.get(INPLACE_TIMEOUT_ENV) or 60)
        self.backend = dist.get_backend()
        self.sockets = group_sockets()
        self._bound_first_group()
        self.lock = threading.Lock()  # held while the group's sockets are shut or the group destroyed
        self.min_world = int(os.environ.get(INPLACE_MIN_WORLD_ENV) or 1)
        self._rejoins: tuple[int, int] = (-1, 0)  # (committed step, re-formations at it)
        self.watcher = Watcher(self)
        self.start()

    @property
    def store(self) -> dist.TCPStore:
        """The main thread's client of the workers' store (a standby's after a move)."""
        return self.stores.client

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def key(self, what: str) -> str:
        return generation_key(self.generation, what)

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

    def took_admission(self) -> None:
        """A newcomer's caller took the job's state: its admission is done."""
        self.joined = None

    # -- the watcher ---------------------------------------------------------------------------
    def start(self) -> None:
        """Heartbeat and watch (again, after ``stop``: a Trainer's second ``fit``)."""
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()

    def shut_group(self, generation: int) -> None:
        """End this generation's pending collectives now (the watcher, on an alarm; ``rejoin``)."""
        with self.lock:
            if generation == self.generation and self.sockets:
                shut_sockets(self.sockets, self.stores.port)
                self.sockets = set()

    def raise_alarm(self, client: dist.Store | None = None) -> None:
        """Tell every rank of this generation to drop its collectives and rejoin (first caller's time kept)."""
        (client or self.store).compare_set(self.key("alarm"), "", f"{time.time():.3f}")

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

    # -- growing (admission.py) ----------------------------------------------------------------
    def grow(self) -> Regrouped | None:
        """After the step whose commit said newcomers wait, on every rank: rank 0 admits every node whose ranks
        all announced themselves and still beat, and all form the next generation with them (survivors first, in
        their order: rank 0 stays rank 0). None when nobody was admitted (the newcomers fell silent)."""
        self.grow_due = False
        key = self.key("grow")
        if self.rank == 0:
            joined = self.joins.admissible(self.store, self.watcher.seen, self.members)
            admission.publish(self.store, key, admission.grow_decision(
                joined, self.members, self.where, self.committed, self.generation, self.stores.with_joined(joined)))
        decision = json.loads(self.store.get(key))
        self.joins.admitted(decision["joined"])
        if not decision["joined"]:
            return None
        self.stores.learn(decision)
        old_world = len(self.members)
        self.where = {int(k): v for k, v in decision["where"].items()}
        self._next_group(decision["members"])
        return Regrouped(self.generation, self.rank, len(self.members), old_world, [], self.committed, False,
                         decision["at"], tuple(decision["joined"]), decision["t0"])

    def accept_joins(self) -> None:
        """Say in the store that this job admits newcomers at its step boundaries (the Trainer and InPlaceRecovery
        do): only then does a returning node's launcher join in place (launch/rendezvous.py); otherwise it takes the
        restart path. Called on every rank: rank 0 writes it; any survivor says it again in a store moved to."""
        self.accepting = True
        if self.rank == 0:
            self.store.set(INPLACE_ACCEPTS_JOINS_KEY, "1")

    # -- re-forming (regroup.py) ----------------------------------------------------------------
    def rejoin(self, error: BaseException) -> Regrouped:
        """After a failed collective: agree with the survivors on members and step, and form the next group."""
        if regroup.timed_out(error) and regroup.peers_beat(self.watcher.seen, self.members, self.me):
            regroup.raise_stuck(self.rank, self.timeout_s, self.committed, error)  # a rank is stuck, not lost
        if not regroup.is_peer_loss(error):
            raise error
        step, count = self._rejoins
        self._rejoins = (self.committed, count + 1 if step == self.committed else 1)
        if self._rejoins[1] > regroup.MAX_REJOINS_WITHOUT_PROGRESS:
            raise RuntimeError(f"lockstep: in-place recovery: re-formed {regroup.MAX_REJOINS_WITHOUT_PROGRESS} times "
                               f"at step {self.committed} without a step done; the error is not a lost peer") from error
        self.shut_group(self.generation)  # our pending operations end now, not at the gloo timeout
        self._check_in(error)
        decision = regroup.decide(self.store, self.key, self.members, self.watcher.seen)
        if not self.stores.quorum(self.members, decision["members"], self.generation):
            raise RuntimeError(f"lockstep: in-place recovery: node {self.stores.moved_from}, which served the "
                               f"workers' store, is gone and {len(decision['members'])} of {len(self.members)} "
                               "ranks are left: not a majority, so this side stops (a cut link would otherwise leave "
                               "two jobs training; docs/preemptible.md)") from error
        refusal = regroup.why_not_go_on(decision, self.me, self.members, self.generation, self.min_world,
                                        self.committed, self.ready)
        if refusal is not None:
            raise RuntimeError(f"lockstep: in-place recovery: {refusal}") from error
        step = decision["committed"]
        alarm_at = float(self.store.get(self.key("alarm")).decode())
        old_world, left = len(self.members), sorted(set(self.members) - set(decision["members"]))
        self._next_group(decision["members"])
        rolled_forward = step != self.committed
        self.committed = self.ready = step
        return Regrouped(self.generation, self.rank, len(self.members), old_world, left, step, rolled_forward,
                         alarm_at)

    def _check_in(self, error: BaseException) -> None:
        """Raise the alarm and check in (``regroup.check_in``); where the store's node is gone, at the successor's
        standby store (``_move_store``)."""
        try:
            self.raise_alarm()
            regroup.check_in(self.store, self.key(f"joined/{self.me}"), self.committed, self.ready)
        except Exception as store_error:  # the store's node is gone: move to the successor's standby store
            if not self._move_store():
                raise RuntimeError(f"lockstep: in-place recovery: the workers' store at {self.stores.host}:"
                                   f"{self.stores.port} stopped answering ({store_error}) and no other node's "
                                   "standby store answered") from error
            self.raise_alarm()
            regroup.check_in(self.store, self.key(f"joined/{self.me}"), self.committed, self.ready)

    def _move_store(self) -> bool:
        """The workers' store stopped answering: go on with a standby store (store_move.py). False where none
        answered."""
        found = self.stores.find_standby(self.members, self.generation, self.accepting)
        if found is None:
            return False
        with self.lock:
            self.watcher.restart_silence(self.members)  # every heartbeat so far went to the old store
            self.joins = Joins()  # the announcements start again in this store
            self.stores.move_to(found, self.generation)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = self.stores.host, str(self.stores.port)
        return True

    def _next_group(self, members: list[int]) -> None:
        with self.lock:  # the watcher must not shut sockets that the next group may reuse
            self.sockets = set()
            dist.destroy_process_group()
            self.generation += 1
            self.members = members
        before = socket_fds()
        store = dist.PrefixStore(self.key("pg"), self.store)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=len(members),
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        with self.lock:
            self.sockets = socket_fds() - before
        # what a reader of the environment sees (report_resume, hang reports) follows the new group
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(self.rank), str(len(members))

    def settle(self) -> None:
        """After the caller re-bound its model to the new group: let the old group's works, and with them its
        sockets and threads, go now (the graveyard keeps works 5 s: ``lockstep.ddp.lifetime``)."""
        from lockstep.ddp.lifetime import let_go_of_finished

        gc.collect()  # the old reducer lives in a reference cycle (its hooks point back at it)
        let_go_of_finished()

    # -- telling the others --------------------------------------------------------------------
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

    def report(self, outcome: Regrouped, step: int, resumed_at: int) -> None:
        """Rank 0 of the new group, after its first step at the new size: the launcher's line
        (``node 1 (10.201.0.2) left at step 812: world 4 -> 2 in 1.8 s, 0 steps lost``). ``resumed_at``: the step the
        loop went on from; below the committed one where it went back further (DiLoCo: to its last sync)."""
        if self.rank != 0:
            return
        now = time.time()
        record = {"left": outcome.left, "old_world": outcome.old_world_size, "world": outcome.world_size,
                  "step": outcome.committed, "seconds": now - outcome.alarm_at,
                  "lost": max(0, outcome.committed - resumed_at),
                  "first_step": step, "joined": list(outcome.joined),
                  "where": {str(k): v for k, v in self.where.items()}}
        if outcome.joined:  # from the newcomers' launcher start; and what the grow cost the others
            record["seconds"], record["paused"] = now - (outcome.joiners_t0 or now), now - outcome.alarm_at
        key, payload = f"{INPLACE_REPORT_KEY}/{outcome.generation}", json.dumps(record)
        self.store.set(key, payload)
        self.store.set(f"{INPLACE_REPORT_KEY}/latest", str(outcome.generation))  # where a launcher that joined starts
        self._mirror_report(key, payload)

    def _mirror_report(self, key: str, payload: str) -> None:
        """The record in the standby store of every other node with members too, so that a launcher's line survives
        the store moving before its report thread read it (seen: node 1's own "joined" line lost when node 0,
        serving the store, was killed within a second of admitting it; the survivors moved to node 1's standby,
        where the record was not). Once a membership change, a connect and a set a node (live ones: a few ms);
        best effort, and the clients go before this returns (no socket or thread outlives the report)."""
        nodes = {self.stores.node_of.get(rank) for rank in self.members} - {self.stores.store_node}
        for node in sorted(n for n in nodes if n is not None and n in self.stores.standby):
            host, port = self.stores.standby[node]
            try:
                connect(host, port, STANDBY_CONNECT_S).set(key, payload)
            except Exception:  # a line for the launcher only: training goes on without it
                pass


def wanted() -> bool:
    """In-place recovery is on for this process (``lockstep launch --nnodes MIN:MAX``, or LOCKSTEP_INPLACE=1).

    gloo only: what ends a lost peer's waits here (shutting the group's TCP sockets) is gloo's; NCCL runs keep
    the restart path (an NCCL communicator would need its own abort, untested here). At any world size, one rank
    included: a job that started with one node of one rank grows in place when a second machine comes (until
    2026-11-26 it took the restart path, from its last checkpoint)."""
    return os.environ.get(INPLACE_ENV) == "1" and dist.is_initialized() and dist.get_backend() == "gloo"
