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
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import signal
import socket
import sys
import threading
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

from lockstep.network import route_source_addr, serve_store

BACKEND = "lockstep"
_READ_TIMEOUT_S = 60  # one store operation (torch's default for its c10d backend)
_HEARTBEAT_S = 1.0
_handlers: dict[str, "LockstepRendezvous"] = {}  # run_id -> the handler of this process's agent (for the report)


class NodesDisagree(RendezvousError):
    """The nodes were launched with contradictory layouts (--nnodes, --node-rank)."""


def _serve(host: str, port: int, what: str) -> dist.TCPStore:
    """A store server on ``host:port``; on all interfaces only if ``host`` is not an address of this machine."""
    try:
        return serve_store(host, port, _READ_TIMEOUT_S)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:  # e.g. the port is taken: say so, naming it
            raise RendezvousConnectionError(f"node 0 cannot serve the {what}: {e.strerror}") from None
    # The master address is not one of ours (NAT, a load balancer's name): listen everywhere, as torch does.
    print(f"lockstep launch: {host} is not an address of this machine; the {what} listens on all interfaces "
          f"(port {port})", file=sys.stderr, flush=True)
    return serve_store("0.0.0.0", port, _READ_TIMEOUT_S)


def _connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    store.set_timeout(datetime.timedelta(seconds=_READ_TIMEOUT_S))
    return store


def _answers(host: str, port: int, timeout_s: float) -> bool:
    """Whether the store at host:port answers within ``timeout_s`` (on a thread: a silent peer blocks the call)."""
    answered = threading.Event()

    def probe() -> None:
        try:
            _connect(host, port, timeout_s).add("lockstep/probe", 1)
            answered.set()
        except Exception:
            pass

    threading.Thread(target=probe, daemon=True).start()
    return answered.wait(timeout_s)


def _worker_pids() -> list[int]:
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


class _Liveness(threading.Thread):
    """Heartbeats in the rendezvous store, on a connection of its own with short timeouts.

    Runs beside the agent's main thread, which may be blocked in a store call of torch's rendezvous
    for its 60 s read timeout when the link is down: so the verdict is acted on here (``on_lost``).
    """

    def __init__(self, master: tuple[str, int], prefix: str, node_rank: int, nodes: list[dict], timeout_s: float,
                 on_lost):
        super().__init__(name="lockstep-liveness", daemon=True)
        self.master, self.prefix, self.node_rank, self.nodes, self.timeout_s = master, prefix, node_rank, nodes, timeout_s
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
        while not self.stop.wait(_HEARTBEAT_S) and self.lost is None:
            now = time.monotonic()
            if now - self.last_ok > self.timeout_s:
                addr, port = self.master
                self.lost = (f"node 0 ({addr}), which holds the rendezvous store at {addr}:{port}, "
                             f"has not answered for {now - self.last_ok:.0f} s")
            for j, (_, changed) in list(self.seen.items()):
                if now - changed > self.timeout_s and now - self.last_ok < 2 * _HEARTBEAT_S + 1:
                    node = next(n for n in self.nodes if n["node_rank"] == j)
                    self.lost = f"node {j} ({node['addr']}, {node['host']}) sent no heartbeat for {now - changed:.0f} s"
        if self.lost is not None and not self.stop.is_set():
            self.on_lost(self.lost)

    def _beat(self) -> None:
        client = None
        while not self.stop.wait(_HEARTBEAT_S) and self.lost is None:
            try:
                if client is None:
                    client = _connect(*self.master, timeout_s=min(5.0, self.timeout_s))
                client.add(f"{self.prefix}/{self.node_rank}", 1)
                beats = {j: client.add(f"{self.prefix}/{j}", 0) for j in self.seen}
            except Exception:  # a failed client may be out of step with the server: start a new one
                client = None
                continue
            now = time.monotonic()
            self.last_ok = now
            for j, beat in beats.items():
                if beat != self.seen[j][0]:
                    self.seen[j] = (beat, now)


class _Poller(threading.Thread):
    """Asks torch's handler how many nodes wait to join, off the agent's main thread (it may block on the store)."""

    def __init__(self, inner: RendezvousHandler):
        super().__init__(name="lockstep-nodes-waiting", daemon=True)
        self.inner, self.waiting, self.stop = inner, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(_HEARTBEAT_S):
            try:
                self.waiting = self.inner.num_nodes_waiting()
            except Exception:  # the store is unreachable: the liveness check decides what that means
                self.waiting = 0


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
        self.local_addr = "127.0.0.1" if self.single else route_source_addr(self.master_addr)
        self.lost_reason: str | None = None  # set when a node was lost; the launcher's report names it
        self._worker_store: dist.TCPStore | None = None
        self._watchdog: _Liveness | None = None
        self._poller: _Poller | None = None

    # ------------------------------------------------------------------ the round
    def next_rendezvous(self) -> RendezvousInfo:
        self._stop_watchdog()
        if self.lost_reason is not None and self.node_rank != 0:
            self._wait_for_store()
        self._check_layout()
        try:
            info = self._inner.next_rendezvous()
        except RendezvousError:
            error_key = f"lockstep/{self._params.run_id}/error"
            if self._store.check([error_key]):  # another node found the layouts contradictory and closed the round
                raise NodesDisagree(self._store.get(error_key).decode()) from None
            raise
        store, world_size = info.store, info.world_size
        nodes = self._exchange(store, info.rank, world_size)
        if self.node_rank == 0:
            self._worker_store = None  # the last round's server goes first (and with it, its keys)
            host = "127.0.0.1" if self.single else self.master_addr
            self._worker_store = _serve(host, 0, "workers' store (MASTER_PORT)")
            store.set("lockstep/worker_store", json.dumps({"port": self._worker_store.port, "token": uuid.uuid4().hex}))
        meta = json.loads(store.get("lockstep/worker_store"))
        if not self.single:
            self._watchdog = _Liveness((self.master_addr, self.master_port), f"lockstep/alive/{meta['token']}",
                                       self.node_rank, nodes, self.node_timeout_s, self._lose)
            self._poller = _Poller(self._inner)
            self._watchdog.start()
            self._poller.start()
        master = "127.0.0.1" if self.single else self.master_addr
        return RendezvousInfo(store, self.node_rank, world_size, RendezvousStoreInfo(master, int(meta["port"])))

    def _check_layout(self) -> None:
        """Nodes with different --nnodes never complete torch's round (each waits for its own count): the
        first node to arrive records its count, a node that disagrees says so and closes the rendezvous."""
        run_id, nnodes = self._params.run_id, int(self._params.max_nodes)
        me = f"{nnodes} {self.local_addr} {socket.gethostname()}"
        first = self._store.compare_set(f"lockstep/{run_id}/nnodes", "", me).decode()
        if first.split()[0] != str(nnodes):
            count, addr, host = first.split()
            message = (f"the nodes disagree on --nnodes: {addr} ({host}) --nnodes {count}, "
                       f"{self.local_addr} ({socket.gethostname()}) --nnodes {nnodes}")
            self._store.set(f"lockstep/{run_id}/error", message)
            self._inner.set_closed()
            raise NodesDisagree(message)

    def _exchange(self, store: dist.Store, rank: int, world_size: int) -> list[dict]:
        me = {"node_rank": self.node_rank, "nnodes": int(self._params.max_nodes), "addr": self.local_addr,
              "host": socket.gethostname()}
        store.set(f"lockstep/node/{rank}", json.dumps(me))
        nodes = [json.loads(store.get(f"lockstep/node/{i}")) for i in range(world_size)]
        said = sorted({n["nnodes"] for n in nodes})
        if said != [world_size]:
            each = ", ".join(f"{n['addr']} ({n['host']}) --nnodes {n['nnodes']}" for n in nodes)
            raise NodesDisagree(f"the nodes disagree on --nnodes: {each}; {world_size} nodes joined")
        ranks = sorted(n["node_rank"] for n in nodes)
        if ranks != list(range(world_size)):
            twice = sorted({r for r in ranks if ranks.count(r) > 1})
            each = ", ".join(f"{n['addr']} ({n['host']}) --node-rank {n['node_rank']}" for n in nodes)
            raise NodesDisagree(f"--node-rank {twice} given to more than one node: {each}")
        return sorted(nodes, key=lambda n: n["node_rank"])

    def _wait_for_store(self) -> None:
        deadline = time.monotonic() + self.rdzv_timeout_s
        while True:
            if _answers(self.master_addr, self.master_port, timeout_s=5):
                return
            if time.monotonic() > deadline:
                raise RendezvousConnectionError(
                    f"{self.lost_reason}, and it did not come back within --rdzv-timeout {self.rdzv_timeout_s:.0f}s"
                )
            time.sleep(1)

    # ------------------------------------------------------------------ while the workers run
    def num_nodes_waiting(self) -> int:
        if self._poller is not None:
            return 0 if self.lost_reason else self._poller.waiting
        return self._inner.num_nodes_waiting()  # one node: the store is local and answers at once

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        first = self.node_rank * self.nproc
        print(f"lockstep launch: {reason} (a cut link or a dead node); stopping ranks {first}-{first + self.nproc - 1} "
              f"on this node (node {self.node_rank})", file=sys.stderr, flush=True)
        for pid in _worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)  # not SIGTERM: a graceful stop would wait on collectives that cannot finish
            except ProcessLookupError:
                pass

    def _stop_watchdog(self) -> None:
        for thread in (self._watchdog, self._poller):
            if thread is not None:
                thread.stop.set()
        self._watchdog = self._poller = None

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
        if self.lost_reason is not None and self.node_rank != 0:
            return False  # node 0's store is gone or unreachable: closing it would only wait for a timeout
        return self._inner.shutdown()


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
            store = _connect(host, port, timeout_s)
        except Exception as e:
            raise RendezvousConnectionError(
                f"nobody answered at {host}:{port} (--master-addr/--master-port) within --rdzv-timeout "
                f"{timeout_s:.0f}s: is `lockstep launch --node-rank 0` running there? ({type(e).__name__}: {e})"
            ) from None
    handler = LockstepRendezvous(params, store, create_c10d_handler(store, C10dRendezvousBackend(store, params.run_id), params))
    _handlers[params.run_id] = handler
    return handler


def register() -> None:
    """Make ``rdzv_backend="lockstep"`` known to torch's registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)


def handler_for(run_id: str) -> LockstepRendezvous | None:
    return _handlers.get(run_id)


__all__ = ["BACKEND", "LockstepRendezvous", "NodesDisagree", "create_handler", "handler_for", "register"]
