"""The registry of in-place rounds: node 0's record of the running round, and how a node that starts reads it.

With ``--recovery in-place`` node 0's agent records the running round in the rendezvous store it serves at the job's
endpoint (--master-addr, --master-port), on every change: its workers' store (node 0's, or the standby store they
moved to), the nodes there now, the first id a newcomer may take, the job's id. A node that starts while such a
round runs, and whose workers admit newcomers (a Trainer, or ``InPlaceRecovery`` in a script's loop), joins it in
place (``find_joinable``; launch/rendezvous.py gives it a round of its own); otherwise it takes torch's way. While
node 0 is gone the lowest surviving node's endpoint probe writes the record into a store that answers there again
(launch/store_takeover.py), and a node 0 that starts waits ``RETURN_WAIT_S`` for it.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from lockstep.keys import INPLACE_ACCEPTS_JOINS_KEY, INPLACE_REPORT_KEY
from lockstep.launch.liveness import connect
from lockstep.network import accepts

# A node 0 that starts waits this long for a survivor to write the running round into its fresh store (the
# survivors knock at its endpoint every EndpointProbe.EVERY_S once the workers moved their store): node 0 came
# back, and joins in place instead of starting a job of its own.
RETURN_WAIT_S = 3.0


class JoinRefused(Exception):
    """Starting this node would start a second job beside the running one (the message says why)."""


class RoundRecord:
    """The running round's record at ``key`` in the rendezvous store: what node 0's agent writes (``publish``) and a
    node that starts reads (``read``). ``running``: this agent's copy, without the nodes (the caller's membership)."""

    def __init__(self, store: dist.Store, run_id: str, node_rank: int):
        self.store, self.node_rank = store, node_rank
        self.key = f"lockstep/{run_id}/inplace_round"
        self.running: dict | None = None  # the running round's workers' store, first new id, job, store node

    def start(self, addr: str, port: int, base: int, job: str, round_nodes: list[dict], store_node: int) -> None:
        """A round of torch's started in place: its workers' store, and ``base``, the first id a newcomer takes."""
        self.running = {"addr": addr, "port": port, "base": base, "job": job, "round_nodes": round_nodes,
                        "store_node": store_node}

    def follow(self, running: dict) -> None:
        """A node that joined in place keeps the record it joined by (a node 0 come back writes it again)."""
        self.running = {k: v for k, v in running.items() if k != "nodes"}

    def moved(self, addr: str, port: int, gone: int, store_node: int) -> None:
        """The workers moved their store to ``store_node``'s standby (``gone`` served it)."""
        assert self.running is not None
        self.running = {**self.running, "addr": addr, "port": port, "moved_from": gone, "store_node": store_node}

    def with_nodes(self, nodes: list[dict]) -> dict:
        """The record as written: the running round with the nodes there now."""
        assert self.running is not None
        return {**self.running, "nodes": nodes}

    def publish(self, nodes: list[dict]) -> None:
        """Node 0's agent records the running round in the store it serves at the job's endpoint, on every change,
        whether the workers' store moved or not (a node 0 that came back and joined serves a new one there)."""
        if self.node_rank == 0 and self.running is not None:
            self.store.set(self.key, json.dumps(self.with_nodes(nodes)))

    def forget(self) -> None:
        """Node 0, before torch's round: the round's workers are gone, nobody may join them now."""
        self.store.delete_key(self.key)

    def await_record(self) -> None:
        """Node 0 that starts: a survivor writes the running round into its fresh store if one runs."""
        deadline = time.monotonic() + RETURN_WAIT_S
        while time.monotonic() < deadline and not self.store.check([self.key]):
            time.sleep(0.1)

    def read(self) -> dict | None:
        return json.loads(self.store.get(self.key)) if self.store.check([self.key]) else None


def find_joinable(record: RoundRecord, node_rank: int, master: tuple[str, int], node_timeout_s: float) -> dict | None:
    """The running round a node that starts joins in place, once its own last workers were let go; None: take
    torch's way (no round runs, it just ended, or its workers admit nobody). Raises ``JoinRefused`` where torch's
    way would start a second job (the workers went on without node 0 and cannot be found, or admit nobody), or
    where this ``--node-rank`` trains in the job already. ``master``: the job's endpoint (--master-addr, --master-port).
    """
    running = record.read()
    if running is None:
        return None
    addr = running.get("addr", master[0])  # node 0's, or the standby store the workers moved to
    accepts_joins = admits(addr, running["port"])
    if accepts_joins is None and "moved_from" in running:  # a survivor wrote it, and node 0's launcher runs
        raise JoinRefused(f"node {node_rank}: the running job's store recorded at {master[0]}:{master[1]} ({addr}:"
                          f"{running['port']}) does not answer: the workers moved it again (its node was lost) and "
                          "this node cannot find them; starting here would start a second job")
    if accepts_joins is None:
        return None  # the round just ended: torch's rendezvous decides
    if not accepts_joins and "moved_from" in running:  # torch's round would be a second job, node 0's own
        raise JoinRefused(f"node {node_rank} came back, but the job went on without it (its store moved to "
                          f"{addr}) and admits no newcomer in place: starting here would "
                          "start a second job; start this node once the job has ended")
    if not accepts_joins:
        return None  # workers that admit nobody (no Trainer or InPlaceRecovery said so): the restart path
    there = {n["node_rank"]: n for n in running["nodes"]}
    deadline = time.monotonic() + node_timeout_s
    while node_rank in there and time.monotonic() < deadline:  # this node's last workers, not yet let go
        time.sleep(1)
        running = record.read()
        if running is None:
            return None
        there = {n["node_rank"]: n for n in running["nodes"]}
    if node_rank in there:
        raise JoinRefused(f"--node-rank {node_rank} is training in this job already "
                          f"({there[node_rank]['addr']}); give this node another --node-rank")
    return running


def admits(host: str, port: int) -> bool | None:
    """Whether the running workers' store at host:port admits newcomers in place; None: it does not answer."""
    try:
        if not accepts(host, port, 5):
            return None  # gone: no TCPStore client's refused tries (each logs a line)
        return connect(host, port, 10).check([INPLACE_ACCEPTS_JOINS_KEY])
    except Exception:
        return None


def next_report(host: str, port: int) -> int:
    """The generation of the next in-place record in the running workers' store at host:port (1 where none was
    written there yet: the report passes over generations whose record never comes)."""
    try:
        store = connect(host, port, 10)
        latest = f"{INPLACE_REPORT_KEY}/latest"
        return int(store.get(latest)) + 1 if store.check([latest]) else 1
    except Exception:
        return 1
