"""lockstep's rendezvous for torch's elastic agent: torch's c10d rendezvous, plus what several real hosts need.

torch's dynamic (c10d) rendezvous orders the nodes by (host name, pid), so global rank 0
lands on whichever node sorts first, and it publishes the host name of that node as
MASTER_ADDR: on hosts that share a name (containers, cloud images) or whose name resolves
to 127.0.0.1 the workers dial loopback and hang. Its stores listen on every interface.
This handler runs torch's rendezvous unchanged and then, in the round's store:

* every node publishes its ``--node-rank``, ``--nnodes`` and address; the round fails on
  every node, naming them, when they disagree; the agent then numbers nodes by
  ``--node-rank`` (node 0 holds global rank 0);
* node 0 serves a fresh store for the workers (per round, so a restarted group never reads
  the dead one's keys: PyTorch #135712) on the master address (loopback on one node), and
  every worker gets ``MASTER_ADDR=--master-addr``;
* on several nodes a watchdog thread beats a heart in the rendezvous store every second;
  when another node (or the store on node 0) stays silent for ``--node-timeout`` seconds,
  this node's workers are stopped, the loss is reported naming the node, and the agent
  restarts the group (``--max-restarts``) or fails: never gloo's 30-minute timeout.

With ``--recovery in-place`` two more parts join in, each a module of its own:

* the registry of in-place rounds (launch/inplace_rounds.py): node 0 records the running round (its workers'
  store, its nodes) in the rendezvous store. A node that starts while such a round runs, and whose workers admit
  newcomers (a Trainer, or ``InPlaceRecovery`` in a script's loop), skips torch's rendezvous: its agent gets a round
  of its own (rank 0 of 1, so torch's rank assignment and exit barrier need nobody else), its workers the running
  job's store and ``LOCKSTEP_INPLACE_JOIN``, and they join the running group at a step boundary (train/inplace/).
  The running agents never see a node waiting, so they restart nothing. Otherwise (no such round, workers that
  admit nobody) the node takes torch's way: the running agents see it waiting and restart their workers at the
  larger size;
* the store takeover (launch/store_takeover.py): no node is special in place. Every agent also serves a standby
  store, listed in the round's records; when node 0's stores stop answering, the survivors' workers move to the
  standby store of the lowest surviving node (train/inplace/store_move.py, fenced by the generation) and go on;
  the agents find the store they moved to (``_find_standby``) and follow: heartbeats, the in-place lines, torch's
  exit barrier. The lowest surviving node knocks at node 0's endpoint; a node 0 that starts waits for such a
  record in its new store, and joins the running job in place when it finds one.

This module keeps torch's round and what each node does in it; it holds one object of each part and calls them.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import time
import uuid

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from lockstep import keys
from lockstep.launch import elastic
from lockstep.launch.inplace_rounds import JoinRefused, RoundRecord, find_joinable, next_report
from lockstep.launch.liveness import READ_TIMEOUT_S, Liveness, Poller, answers, connect, worker_pids
from lockstep.launch.store_takeover import Takeover
from lockstep.network import route_source_addr, serve_store

BACKEND = "lockstep"
_handlers: dict[str, LockstepRendezvous] = {}  # run_id -> the handler of this process's agent (for the report)


class NodesDisagree(RendezvousError):
    """The nodes were launched with contradictory layouts (--nnodes, --node-rank)."""


def _serve(host: str, port: int, what: str) -> dist.TCPStore:
    """A store server on ``host:port``; on all interfaces only if ``host`` is not an address of this machine."""
    try:
        return serve_store(host, port, READ_TIMEOUT_S)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:  # e.g. the port is taken: say so, naming it
            raise RendezvousConnectionError(f"node 0 cannot serve the {what}: {e.strerror}") from None
    # The master address is not one of ours (NAT, a load balancer's name): listen everywhere, as torch does.
    print(f"lockstep launch: {host} is not an address of this machine; the {what} listens on all interfaces "
          f"(port {port})", file=sys.stderr, flush=True)
    return serve_store("0.0.0.0", port, READ_TIMEOUT_S)


class LockstepRendezvous(RendezvousHandler):
    """torch's c10d handler with node-rank ordering, a reachable master, bound stores and a liveness check."""

    def __init__(self, params: RendezvousParameters, store: dist.Store, inner: RendezvousHandler):
        self._params, self._store, self._inner = params, store, inner
        self.node_rank = int(params.get("lockstep_node_rank"))
        self.nproc = int(params.get("lockstep_nproc"))
        self.master_addr, self.master_port = params.get("lockstep_master_addr"), int(params.get("lockstep_port"))
        self.node_timeout_s = float(params.get("lockstep_node_timeout"))
        self.rdzv_timeout_s = float(params.get("join_timeout"))
        self.single = params.max_nodes == 1
        # --nnodes MIN:MAX --recovery in-place: the workers re-form the group themselves when a node is lost
        self.in_place = params.get_as_bool("lockstep_inplace", False)
        self.local_addr = "127.0.0.1" if self.single else route_source_addr(self.master_addr)
        self.lost_reason: str | None = None  # set when a node was lost; the launcher's report names it
        # Why this node last stopped its own workers; kept past the next round, read once by the restart line
        # (which would otherwise say "worker rank 0 failed (killed by SIGKILL)").
        self._stopped_workers_because: str | None = None
        self.min_nodes, self.max_nodes = int(params.min_nodes), int(params.max_nodes)
        # --nnodes as given: "2", or "1:2" for an elastic job (launch/elastic.py); every node must say the same
        self.nnodes_spec = (
            str(self.max_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"
        )
        self.group_rank = self.node_rank  # this node's index among the nodes of the round (elastic: fewer may be there)
        self._last_nodes: list[dict] | None = None  # the previous round's nodes, for the membership line
        self._report: elastic.ResumeReport | None = None
        self._in_place_report: elastic.InPlaceReport | None = None
        self._round: tuple[dist.Store, int] | None = None  # the round's store and node count (the exit barrier's)
        self._worker_store: dist.TCPStore | None = None
        self._watchdog: Liveness | None = None
        self._poller: Poller | None = None
        # in place: the running round's record in the rendezvous store (node 0 writes it; launch/inplace_rounds.py)
        self._record = RoundRecord(store, params.run_id, self.node_rank)
        self.joined_in_place = False  # this node's workers joined a running in-place round (``_join_running``)
        # in place, several nodes: this agent's standby store, and following the workers when they move their store
        # there (launch/store_takeover.py)
        self._takeover = Takeover()
        self._round_nodes: list[dict] = []  # the nodes of torch's round: launch rank r ran on node r // nproc
        self._token = ""  # the round's workers' store token: names this round's keys in a store moved to
        self._started_at = _process_start_time()  # the launcher's start: a join line counts from it
        self.job_id = ""  # the job's id (``_set_job_id``; a node that joins in place takes the running job's)

    # ------------------------------------------------------------------ the round
    def next_rendezvous(self) -> RendezvousInfo:
        self._stop_watchdog()
        in_place = self.in_place and not self.single
        if in_place:
            joined = self._before_in_place_round()
            if joined is not None:
                return joined
        if self.lost_reason is not None and self.node_rank != 0:
            self._wait_for_store()
        self._check_layout()
        try:
            info = self._inner.next_rendezvous()
        except RendezvousError:
            error_key = f"lockstep/{self._params.run_id}/error"
            if self._store.check([error_key]):  # another node found the layouts contradictory and closed the round
                message = self._store.get(error_key).decode()
                self._store.add(f"{error_key}_read", 1)  # node 0 keeps serving the store until someone read it
                raise NodesDisagree(message) from None
            raise
        store, world_size = info.store, info.world_size
        nodes = self._exchange(store, info.rank, world_size)
        # numbered by --node-rank among the nodes present: node 0 (the store's host) holds global rank 0
        self.group_rank = [n["node_rank"] for n in nodes].index(self.node_rank)
        self.lost_reason = None  # the round re-formed without the lost node (or with it back)
        if self.node_rank == 0:
            self._worker_store = None  # the last round's server goes first (and with it, its keys)
            host = "127.0.0.1" if self.single else self.master_addr
            self._worker_store = _serve(host, 0, "workers' store (MASTER_PORT)")
            store.set("lockstep/worker_store", json.dumps({"port": self._worker_store.port, "token": uuid.uuid4().hex}))
        meta = json.loads(store.get("lockstep/worker_store"))
        self._set_job_id()
        if not self.single:
            self._watchdog = Liveness((self.master_addr, self.master_port), f"lockstep/alive/{meta['token']}",
                                       self.node_rank, nodes, self.node_timeout_s, self._lose,
                                       self._find_standby if in_place else None)
            self._token = meta["token"]
            self._poller = Poller(self._inner)
            self._watchdog.start()
            self._poller.start()
        master = "127.0.0.1" if self.single else self.master_addr
        change = elastic.describe_change(self._last_nodes, nodes, self.nproc)
        self._last_nodes = nodes
        if change is not None:  # one line once the workers say which step they resumed from
            self._report = elastic.ResumeReport(change, master, int(meta["port"]))
            self._report.start()
        self._round = (store, world_size)
        if in_place:
            self._start_in_place_round(store, nodes, master, int(meta["port"]))
        return RendezvousInfo(self._round[0], self.group_rank, world_size,
                              RendezvousStoreInfo(master, int(meta["port"])))

    def _set_job_id(self) -> None:
        """The job's id for the workers (the run folder's fence, train/fence.py): made once by node 0's agent in
        its rendezvous store, so the same for every node, round and restart of this launch; a node that joins in
        place takes the running job's (``_join_running``)."""
        if self.node_rank == 0:
            self._store.compare_set(elastic.JOB_KEY, "", uuid.uuid4().hex[:12])
        self.job_id = self._store.get(elastic.JOB_KEY).decode()
        os.environ[keys.JOB_ENV] = self.job_id

    def _before_in_place_round(self) -> RendezvousInfo | None:
        """In place, before torch's round: this node's standby store; a node that was never in torch's round joins
        a running one where it finds one (node 0 waits for a survivor to record it in its new store first)."""
        if self._takeover.moved is not None:
            raise RendezvousConnectionError(
                f"node 0's rendezvous store at {self.master_addr}:{self.master_port} is gone (the workers went on in "
                "place without it): torch's next round, which would restart the workers, needs it")
        self._takeover.serve(self.local_addr)
        if self._last_nodes is None:  # never in torch's round: may join a running one
            self.joined_in_place = False
            os.environ.pop(keys.INPLACE_JOIN_ENV, None)  # workers started after torch's round must not try to join
            if self.node_rank == 0:  # its store is new: a survivor writes the running round there if one runs
                self._record.await_record()
            joined = self._join_running()
            if joined is not None:
                return joined
        if self.node_rank == 0:
            self._record.forget()  # the round's workers are gone: nobody may join them now
        return None

    def _start_in_place_round(self, store: dist.Store, nodes: list[dict], master: str, port: int) -> None:
        """The workers learn every node's standby store; torch's exit barrier goes through a relay that can
        follow them; one line per node the workers lose or admit; node 0 records the running round."""
        self._round_nodes = nodes
        self._round = (self._takeover.relay_round(store), len(nodes))
        os.environ[keys.INPLACE_STORES_ENV] = json.dumps({"store_node": nodes[0]["node_rank"], "nodes": [
            {"node_rank": n["node_rank"], "addr": n["addr"], "port": n["standby"],
             "ranks": list(range(i * self.nproc, (i + 1) * self.nproc))} for i, n in enumerate(nodes)]})
        self._in_place_report = elastic.InPlaceReport(master, port, nodes, self.nproc, self._left_in_place,
                                                      self._joined_in_place)
        self._in_place_report.start()
        # a node that starts now joins these workers (``_join_running``): node 0 records them
        self._takeover.store_node = nodes[0]["node_rank"]
        self._record.start(master, port, len(nodes) * self.nproc, self.job_id, nodes, nodes[0]["node_rank"])
        self._publish_round()

    # ------------------------------------------------------------------ joining a running in-place round
    def _publish_round(self) -> None:
        """Node 0's agent records the running round (launch/inplace_rounds.py) with the nodes there now."""
        self._record.publish(self._last_nodes or [])

    # ------------------------------------------------------------------ node 0 gone: the store takeover
    def _find_standby(self) -> tuple[str, int] | None:
        """The liveness thread, once the store has not answered for a while: did the workers move their store
        to a standby (train/inplace/store_move.py)? The agents follow them there; None: they did not (yet)."""
        gone = self._takeover.store_node
        # this node too, even before a record names it (a node that joined)
        known = {n["node_rank"]: n for n in [self._node_record(), *(self._last_nodes or [])]}
        node = self._takeover.find(list(known.values()))
        if node is None:
            return None
        self._moved_to(node, gone)
        return node["addr"], node["standby"]

    def _moved_to(self, node: dict, gone: int) -> None:
        """The workers went on with ``node``'s standby store: so do the in-place lines, torch's exit barrier and,
        on the lowest surviving node, the record of the running round for a node 0 that comes back."""
        addr, port = node["addr"], node["standby"]
        old = next((n for n in self._round_nodes if n["node_rank"] == gone), {"addr": "?"})
        print(f"lockstep launch: node {gone} ({old['addr']}) stopped answering; the workers moved their store to "
              f"node {node['node_rank']} ({addr}:{port}) and go on in place", file=sys.stderr, flush=True)
        for thread in (self._poller, self._in_place_report):
            if thread is not None:
                thread.stop.set()
        stop_heartbeats = getattr(self._inner, "_stop_heartbeats", None)
        if stop_heartbeats is not None:
            stop_heartbeats()  # torch's keep-alive would write to the dead store every 5 s, logging each failure
        self._takeover.move_to(node, self._token)
        self._record.moved(addr, port, gone, node["node_rank"])
        generation = self._in_place_report.generation if self._in_place_report is not None else 1
        self._in_place_report = elastic.InPlaceReport(addr, port, self._round_nodes, self.nproc, self._left_in_place,
                                                      self._joined_in_place, generation)
        self._in_place_report.start()
        lead = min([n["node_rank"] for n in self._last_nodes or [] if n["node_rank"] != gone] + [self.node_rank])
        if lead == self.node_rank and self.node_rank != 0:  # node 0 itself (come back) serves the endpoint's store
            self._takeover.start_probe((self.master_addr, self.master_port), self._record.key,
                                       lambda: self._record.with_nodes(self._last_nodes or []))
        self._publish_round()

    # ------------------------------------------------------------------ joining a running in-place round
    def _join_running(self) -> RendezvousInfo | None:
        """A round runs in place and its workers admit newcomers: join it without torch's rendezvous (which would
        make the running agents restart their workers). None: take torch's way (launch/inplace_rounds.py)."""
        try:
            running = find_joinable(self._record, self.node_rank, (self.master_addr, self.master_port),
                                    self.node_timeout_s)
        except JoinRefused as e:
            raise NodesDisagree(str(e)) from None
        if running is None:
            return None
        addr = running.get("addr", self.master_addr)
        me = self._node_record()
        os.environ.pop(keys.INPLACE_STORES_ENV, None)  # its workers learn the stores with their admission
        # inherited by the workers the agent starts next (torch copies os.environ): process_group.init() joins
        os.environ[keys.INPLACE_JOIN_ENV] = json.dumps({"base": running["base"], "node": me, "t0": self._started_at})
        self.joined_in_place = True
        print(f"lockstep launch: node {self.node_rank} joins the running job in place (workers' store "
              f"{addr}:{running['port']}); its ranks start at the others' next step boundary",
              file=sys.stderr, flush=True)
        self._follow_running(running, addr, int(running["port"]))
        # a round of its own, rank 0 of 1: torch's rank assignment and exit barrier wait for nobody else; through a
        # relay that follows the workers' store if it moves (node 0's rendezvous store may go with node 0)
        own = dist.PrefixStore(f"lockstep/{self._params.run_id}/joined/{self._token}", self._store)
        self._round = (self._takeover.relay_round(own), 1)
        return RendezvousInfo(self._round[0], 0, 1, RendezvousStoreInfo(addr, int(running["port"])))

    def _follow_running(self, running: dict, addr: str, port: int) -> None:
        """A node that joined in place takes part as the others' agents do: the job's id for its workers, a line
        for each membership change, following the workers' store when it moves (node 0 lost: the moved line, and
        on the lowest surviving node the endpoint probe or, on node 0, the record in its own store), so that a
        node that comes back later finds the running job whoever was lost."""
        self.job_id = running.get("job") or self.job_id
        if self.job_id:
            os.environ[keys.JOB_ENV] = self.job_id
        self._token = uuid.uuid4().hex  # names this agent's own exit barrier (``Relay``) in a store moved to
        self._round_nodes = running.get("round_nodes") or running["nodes"]
        self._last_nodes = sorted(running["nodes"], key=lambda n: n["node_rank"])  # this node once admitted
        self._takeover.store_node = int(running.get("store_node", 0))
        self._record.follow(running)
        self._publish_round()
        # from the first record after the newest one there now, read before this node's workers start (a thread that
        # read it later could miss this node's own admission: seen once, at 2 x 2 under load)
        self._in_place_report = elastic.InPlaceReport(addr, port, self._round_nodes, self.nproc, self._left_in_place,
                                                      self._joined_in_place, generation=next_report(addr, port))
        self._in_place_report.start()
        # beats in the workers' store itself (this node is in no torch round); judges no other node: the workers'
        # own heartbeats do that. Its part is the store: gone, it finds the standby the workers moved to
        self._watchdog = Liveness((addr, port), f"lockstep/agent_alive/{self._token}", self.node_rank, [],
                                  self.node_timeout_s, self._lose, self._find_standby)
        self._watchdog.start()

    def _check_layout(self) -> None:
        """Nodes with different --nnodes never complete torch's round (each waits for its own count): the
        first node to arrive records its count, a node that disagrees says so and closes the rendezvous."""
        run_id, nnodes = self._params.run_id, self.nnodes_spec
        me = f"{nnodes} {self.local_addr} {socket.gethostname()}"
        first = self._store.compare_set(f"lockstep/{run_id}/nnodes", "", me).decode()
        if first.split()[0] != nnodes:
            count, addr, host = first.split()
            message = (f"the nodes disagree on --nnodes: {addr} ({host}) --nnodes {count}, "
                       f"{self.local_addr} ({socket.gethostname()}) --nnodes {nnodes}")
            self._store.set(f"lockstep/{run_id}/error", message)
            self._inner.set_closed()
            if self.node_rank == 0:
                # This node serves the store: leaving at once took the message with it, and the node that
                # arrived first failed with a bare "Broken pipe" instead (seen once in test_launch_network).
                # Wait, bounded, until another node has read it.
                deadline = time.monotonic() + min(10.0, self.rdzv_timeout_s)
                while time.monotonic() < deadline and self._store.add(f"lockstep/{run_id}/error_read", 0) < 1:
                    time.sleep(0.1)
            raise NodesDisagree(message)

    def _node_record(self) -> dict:
        """What this node tells the others (a round's exchange, an admission, the search for a standby store)."""
        return {"node_rank": self.node_rank, "addr": self.local_addr, "host": socket.gethostname(),
                **({"standby": self._takeover.standby.port} if self._takeover.standby is not None else {})}

    def _exchange(self, store: dist.Store, rank: int, world_size: int) -> list[dict]:
        me = {**self._node_record(), "nnodes": self.nnodes_spec}
        store.set(f"lockstep/node/{rank}", json.dumps(me))
        try:
            nodes = [json.loads(store.get(f"lockstep/node/{i}")) for i in range(world_size)]
        except dist.DistError as e:  # a node lost between torch's round and this exchange: say so, not the store's
            missing = [i for i in range(world_size) if not store.check([f"lockstep/node/{i}"])]
            raise RendezvousConnectionError(
                f"node {self.node_rank}: the round's node(s) of rendezvous rank {missing} never said who they are "
                f"(lost during the rendezvous?): start them again ({type(e).__name__})") from None
        said = sorted({str(n["nnodes"]) for n in nodes})
        if said != [self.nnodes_spec] or not self.min_nodes <= world_size <= self.max_nodes:
            each = ", ".join(f"{n['addr']} ({n['host']}) --nnodes {n['nnodes']}" for n in nodes)
            raise NodesDisagree(f"the nodes disagree on --nnodes: {each}; {world_size} nodes joined")
        ranks = sorted(n["node_rank"] for n in nodes)
        if len(set(ranks)) != len(ranks) or (self.min_nodes == self.max_nodes and ranks != list(range(world_size))):
            twice = sorted({r for r in ranks if ranks.count(r) > 1})
            each = ", ".join(f"{n['addr']} ({n['host']}) --node-rank {n['node_rank']}" for n in nodes)
            raise NodesDisagree(f"--node-rank {twice} given to more than one node: {each}")
        return sorted(nodes, key=lambda n: n["node_rank"])

    def _wait_for_store(self) -> None:
        deadline = time.monotonic() + self.rdzv_timeout_s
        while True:
            if answers(self.master_addr, self.master_port, timeout_s=5):
                return
            if time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"{self.lost_reason}, and it did not come back within --rdzv-timeout {self.rdzv_timeout_s:.0f}s"
                )
            time.sleep(1)

    # ------------------------------------------------------------------ while the workers run
    def num_nodes_waiting(self) -> int:
        if self.joined_in_place or self._takeover.moved is not None:
            return 0  # not in torch's round (or its store is gone): its waiting nodes are not this agent's
        if self._poller is not None:
            return 0 if self.lost_reason else self._poller.waiting
        return self._inner.num_nodes_waiting()  # one node: the store is local and answers at once

    def _lose(self, reason: str) -> None:
        self.lost_reason = self._stopped_workers_because = reason
        first = self.group_rank * self.nproc
        print(f"lockstep launch: {reason} (a cut link or a dead node); stopping ranks {first}-{first + self.nproc - 1} "
              f"on this node (node {self.node_rank})", file=sys.stderr, flush=True)
        for pid in worker_pids():
            try:
                # not SIGTERM: a graceful stop would wait on collectives that cannot finish
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _left_in_place(self, left: list[dict]) -> None:
        """The workers went on without ``left``: stop watching them, and check in for them at torch's exit barrier
        (the agent waits there for every node of the round, 300 s, once its workers finished)."""
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils.store import _barrier_nonblocking

        if self._watchdog is not None:
            for node in left:
                self._watchdog.forget(node["node_rank"])
        remaining = [n for n in self._last_nodes or [] if n["node_rank"] not in {m["node_rank"] for m in left}]
        self._last_nodes = remaining  # the next round's line compares with the nodes really there
        self._publish_round()  # a node that left may come back in place
        # a joined agent's exit barrier is its own (a round of one): it checks in for nobody
        if self._round is not None and not self.joined_in_place and remaining \
                and self.node_rank == remaining[0]["node_rank"]:
            store, size = self._round
            for _ in left:
                _barrier_nonblocking(store, size, _TERMINAL_STATE_SYNC_ID)

    def _joined_in_place(self, joined: list[dict]) -> None:
        """The workers admitted ``joined``: the next round's line compares with the nodes really there; node 0
        records them as running (a second start of one of them is refused)."""
        there = {n["node_rank"]: n for n in [*(self._last_nodes or []), *joined]}  # a node 0 back replaces its old self
        self._last_nodes = [there[k] for k in sorted(there)]
        self._publish_round()

    def take_stop_reason(self) -> str | None:
        """Why this node stopped its workers since the last call (None: it did not)."""
        reason, self._stopped_workers_because = self._stopped_workers_because, None
        return reason

    def _stop_watchdog(self) -> None:
        for thread in (self._watchdog, self._poller, self._report, self._in_place_report):
            if thread is not None:
                thread.stop.set()
        self._watchdog = self._poller = self._report = self._in_place_report = None
        self._takeover.stop_probe()

    # ------------------------------------------------------------------ delegated
    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers are clients of the per-round store node 0's agent serves

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._stop_watchdog()
        if self.joined_in_place:
            os.environ.pop(keys.INPLACE_JOIN_ENV, None)
            return True  # not in torch's round: closing the rendezvous is node 0's, at the job's end
        if self._takeover.moved is not None or (self.lost_reason is not None and self.node_rank != 0):
            return False  # node 0's store is gone or unreachable: closing it would only wait for a timeout
        return self._inner.shutdown()


def _process_start_time() -> float:
    """When this process started (wall clock), from /proc; now where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
        with open("/proc/uptime") as f:  # to 10 ms (/proc/stat's boot time is whole seconds)
            uptime_s = float(f.read().split()[0])
        return time.time() - (uptime_s - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def create_handler(params: RendezvousParameters) -> LockstepRendezvous:
    """The registry's creator: node 0 serves the rendezvous store on the master address, the others dial it."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_c10d_handler

    host, port = params.get("lockstep_master_addr"), int(params.get("lockstep_port"))
    if params.get_as_bool("is_host"):
        store = _serve(host, port, "rendezvous store")
        params.config["lockstep_port"] = store.port  # port 0 on one node: the one the OS gave
    else:
        timeout_s = float(params.get("join_timeout"))
        try:
            store = connect(host, port, timeout_s)
        except Exception as e:
            raise RendezvousConnectionError(
                f"nobody answered at {host}:{port} (--master-addr/--master-port) within --rdzv-timeout "
                f"{timeout_s:.0f}s: is `lockstep launch --node-rank 0` running there? ({type(e).__name__}: {e})"
            ) from None
    handler = LockstepRendezvous(
        params, store, create_c10d_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    )
    _handlers[params.run_id] = handler
    return handler


def register() -> None:
    """Make ``rdzv_backend="lockstep"`` known to torch's registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)


def handler_for(run_id: str) -> LockstepRendezvous | None:
    return _handlers.get(run_id)


__all__ = ["BACKEND", "LockstepRendezvous", "NodesDisagree", "create_handler", "handler_for", "register"]
