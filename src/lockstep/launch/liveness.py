"""Is every node still there? Heartbeats through the rendezvous store, judged off the agent's main thread.

Each node's agent adds 1 to its own counter in the rendezvous store every second and reads the
others'. A counter that stops moving for ``--node-timeout`` seconds means that node is gone; a store
that stops answering means node 0 (which serves it) is gone or cut off. The one idea: a TCPStore
client waits for an answer without a bound when the peer is silent (measured here: > 100 s with a
2 s store timeout), so the store calls run on a thread of their own and the judge only reads the
timestamps they leave; nothing here ever blocks the agent.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler

READ_TIMEOUT_S = 60  # one store operation (torch's default for its c10d backend)
HEARTBEAT_S = 1.0


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
    return store


def answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether the store at host:port answers within ``timeout_s`` (on a thread: a silent peer blocks the call)."""
    answered = threading.Event()

    def probe() -> None:
        try:
            connect(host, port, timeout_s).add("lockstep/probe", 1)
            answered.set()
        except Exception:
            pass

    threading.Thread(target=probe, daemon=True).start()
    return answered.wait(timeout_s)


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
                 on_lost):
        super().__init__(name="lockstep-liveness", daemon=True)
        self.master, self.prefix, self.node_rank, self.nodes, self.timeout_s = (
            master,
            prefix,
            node_rank,
            nodes,
            timeout_s,
        )
        self.on_lost = on_lost
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
            if now - self.last_ok > self.timeout_s:
                addr, port = self.master
                self.lost = (f"node 0 ({addr}), which holds the rendezvous store at {addr}:{port}, "
                             f"has not answered for {now - self.last_ok:.0f} s")
            for j, (_, changed) in list(self.seen.items()):
                if now - changed > self.timeout_s and now - self.last_ok < 2 * HEARTBEAT_S + 1:
                    node = next(n for n in self.nodes if n["node_rank"] == j)
                    self.lost = f"node {j} ({node['addr']}, {node['host']}) sent no heartbeat for {now - changed:.0f} s"
        if self.lost is not None and not self.stop.is_set():
            self.on_lost(self.lost)

    def forget(self, node_rank: int) -> None:
        """Stop judging ``node_rank`` (its workers' peers went on without it: in-place recovery)."""
        self.seen.pop(node_rank, None)

    def _beat(self) -> None:
        client = None
        while not self.stop.wait(HEARTBEAT_S) and self.lost is None:
            try:
                if client is None:
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
