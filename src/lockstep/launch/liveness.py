"""Is every node still there? Heartbeats through the rendezvous store, judged off the agent's main thread.

Each node's agent adds 1 to its own counter in the rendezvous store every second and reads the
others'. A counter that stops moving for ``--node-timeout`` seconds means that node is gone; a store
that stops answering means node 0 (which serves it) is gone or cut off; in place, the agents first look for the
standby store the workers moved to (launch/rendezvous.py) and beat there. The one idea: a TCPStore
client waits for an answer without a bound when the peer is silent (measured here: > 100 s with a
2 s store timeout), so the store calls run on a thread of their own and the judge only reads the
timestamps they leave; nothing here ever blocks the agent.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler

from lockstep.network import accepts

READ_TIMEOUT_S = 60  # one store operation (torch's default for its c10d backend)
HEARTBEAT_S = 1.0
# In place: once the store has not answered for this long, look for the standby store the workers moved to
# (launch/rendezvous.py); a store that is merely slow has none, and the --node-timeout verdict stands.
LOOK_FOR_STANDBY_S = 2.0


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
    return store


def _on_a_thread(timeout_s: float, probe: Callable[[], bool]) -> bool:
    """Whether ``probe()`` returned True within ``timeout_s``, run on a daemon thread: a store call to a silent
    peer blocks without a bound, and the caller must not."""
    done = threading.Event()

    def run() -> None:
        try:
            if probe():
                done.set()
        except Exception:
            pass

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout_s)


def answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether the store at host:port answers within ``timeout_s``."""
    return _on_a_thread(timeout_s, lambda: connect(host, port, timeout_s).add("lockstep/probe", 1) > 0)


def holds(host: str, port: int, key: str, timeout_s: float = 2.0) -> bool:
    """Whether the store at host:port answers within ``timeout_s`` and holds ``key`` (a plain connect first: a
    TCPStore client logs every refused try)."""
    return _on_a_thread(timeout_s,
                        lambda: accepts(host, port, timeout_s) and connect(host, port, timeout_s).check([key]))


def worker_pids() -> list[int]:
    """This agent's workers: its children that torch started with TORCHELASTIC_RUN_ID in their environment."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me and b"TORCHELASTIC_RUN_ID=" in open(f"/proc/{entry}/environ", "rb").read():
                pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return pids


class Liveness(threading.Thread):
    """Heartbeats in the rendezvous store, on a connection of its own with short timeouts.

    Runs beside the agent's main thread, which may be blocked in a store call of torch's rendezvous
    for its 60 s read timeout when the link is down: so the verdict is acted on here (``on_lost``).
    """

    def __init__(self, master: tuple[str, int], prefix: str, node_rank: int, nodes: list[dict], timeout_s: float,
                 on_lost, find_standby=None):
        super().__init__(name="lockstep-liveness", daemon=True)
        self.master, self.prefix, self.node_rank, self.nodes, self.timeout_s = (
            master,
            prefix,
            node_rank,
            nodes,
            timeout_s,
        )
        self.on_lost = on_lost
        # in place: () -> (addr, port) of the standby store the workers moved to, or None (launch/rendezvous.py)
        self.find_standby = find_standby
        self.moves = 0  # the heartbeat thread reconnects when this changes
        self.lost: str | None = None
        self.last_ok = time.monotonic()  # when the store last answered
        # node rank -> (its last heartbeat count, when that count last changed)
        self.seen = {n["node_rank"]: (-1, self.last_ok) for n in nodes if n["node_rank"] != node_rank}
        self.stop = threading.Event()

    def run(self) -> None:
        # A TCPStore client waits for an answer without a bound when the peer is silent (measured: > 100 s
        # with a 2 s store timeout), so the store calls run on a thread of their own and this one only
        # judges the timestamps they leave.
        threading.Thread(target=self._beat, name="lockstep-heartbeat", daemon=True).start()
        while not self.stop.wait(HEARTBEAT_S) and self.lost is None:
            now = time.monotonic()
            if self.find_standby is not None and now - self.last_ok > LOOK_FOR_STANDBY_S:
                moved = self.find_standby()
                if moved is not None:
                    self.move(moved)
                    continue
            if now - self.last_ok > self.timeout_s:
                addr, port = self.master
                holder = "node 0" if self.moves == 0 else "the node"
                self.lost = (f"{holder} ({addr}), which holds the rendezvous store at {addr}:{port}, "
                             f"has not answered for {now - self.last_ok:.0f} s")
            for j, (_, changed) in list(self.seen.items()):
                if now - changed > self.timeout_s and now - self.last_ok < 2 * HEARTBEAT_S + 1:
                    node = next(n for n in self.nodes if n["node_rank"] == j)
                    self.lost = f"node {j} ({node['addr']}, {node['host']}) sent no heartbeat for {now - changed:.0f} s"
        if self.lost is not None and not self.stop.is_set():
            self.on_lost(self.lost)

    def move(self, master: tuple[str, int]) -> None:
        """Beat in the store at ``master`` from now on (the workers moved there: in place, node 0 gone)."""
        now = time.monotonic()
        self.master, self.last_ok = master, now
        self.seen = dict.fromkeys(self.seen, (-1, now))  # every node's silence is judged afresh from here
        self.moves += 1

    def forget(self, node_rank: int) -> None:
        """Stop judging ``node_rank`` (its workers' peers went on without it: in-place recovery)."""
        self.seen.pop(node_rank, None)

    def _beat(self) -> None:
        client, moves = None, 0
        while not self.stop.wait(HEARTBEAT_S) and self.lost is None:
            try:
                if client is None or moves != self.moves:
                    client, moves = None, self.moves
                    if not accepts(*self.master, timeout_s=min(5.0, self.timeout_s)):
                        continue  # gone: no TCPStore client's refused tries (each logs a line)
                    client = connect(*self.master, timeout_s=min(5.0, self.timeout_s))
                client.add(f"{self.prefix}/{self.node_rank}", 1)
                beats = {j: client.add(f"{self.prefix}/{j}", 0) for j in list(self.seen)}
            except Exception:  # a failed client may be out of step with the server: start a new one
                client = None
                continue
            now = time.monotonic()
            self.last_ok = now
            for j, beat in beats.items():
                if j in self.seen and beat != self.seen[j][0]:
                    self.seen[j] = (beat, now)


class Poller(threading.Thread):
    """Asks torch's handler how many nodes wait to join, off the agent's main thread (it may block on the store)."""

    def __init__(self, inner: RendezvousHandler):
        super().__init__(name="lockstep-nodes-waiting", daemon=True)
        self.inner, self.waiting, self.stop = inner, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            try:
                self.waiting = self.inner.num_nodes_waiting()
            except Exception:  # the store is unreachable: the liveness check decides what that means
                self.waiting = 0


class EndpointProbe(threading.Thread):
    """After the workers moved their store (node 0 gone): knocks at node 0's endpoint every ``EVERY_S``; when a store
    answers there (node 0's launcher started again, with a new store), writes the running round into it, and
    again whenever it changes, so that the launcher joins the running job in place (launch/rendezvous.py) instead
    of starting a job of its own. A store there that holds a round record of its own is not a node 0 that came
    back but one that never left (a cut link healed): that is said once, and nothing is written."""

    EVERY_S = 0.5

    def __init__(self, endpoint: tuple[str, int], key: str, record):
        super().__init__(name="lockstep-endpoint-probe", daemon=True)
        self.endpoint, self.key, self.record = endpoint, key, record
        self.stop = threading.Event()

    def run(self) -> None:
        client = None
        while not self.stop.wait(self.EVERY_S):
            try:
                if client is None:
                    if not accepts(*self.endpoint, timeout_s=1.0):
                        continue
                    client = connect(*self.endpoint, timeout_s=2.0)
                    if client.check([self.key]) and "moved_from" not in json.loads(client.get(self.key)):
                        host, port = self.endpoint
                        print(f"lockstep launch: node 0's store at {host}:{port} answers with a running round of its "
                              "own: node 0 was cut off, not gone, and both sides trained meanwhile "
                              "(docs/preemptible.md: a cut link)", file=sys.stderr, flush=True)
                        return
                client.set(self.key, json.dumps(self.record()))
            except Exception:  # node 0 went again: knock until it is back
                client = None
