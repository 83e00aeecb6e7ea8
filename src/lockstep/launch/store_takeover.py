"""The store takeover, launcher side: this agent's standby store, and following the workers when they move to one.

In place, no node is special: every agent serves a standby store, listed in the round's records (and to the
workers in ``keys.INPLACE_STORES_ENV``). When node 0's stores stop answering (every process of node 0 gone), the
workers claim the lowest surviving node's standby store (train/inplace/store_move.py, ``keys.INPLACE_TAKEOVER_KEY``,
fenced by their generation). The agents find that claim (``Takeover.find``) and follow the workers there: torch's
exit barrier goes through a relay that moves with them (``Relay``), and on the lowest surviving node an endpoint
probe tells a node 0 that comes back where the job went (``EndpointProbe``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from lockstep.keys import INPLACE_TAKEOVER_KEY
from lockstep.launch.liveness import READ_TIMEOUT_S, EndpointProbe, connect, holds
from lockstep.network import serve_store


class Relay(dist.Store):
    """The store handed to torch's agent for a round (its rank assignment and exit barrier): node 0's, until the
    workers move their store to a standby (node 0 gone); then that one, so that the survivors' exit barrier meets
    where they are (torch's ``_exit_barrier`` on a dead store would log a traceback and go on unsynchronised)."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner

    def move(self, inner: dist.Store) -> None:
        self.inner = inner

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def wait(self, keys, timeout=None):
        # torch's barrier sets its timeout (300 s) on this store, not on the inner one: pass it on
        return self.inner.wait(keys, self.timeout if timeout is None else timeout)  # type: ignore[attr-defined]

    def multi_get(self, keys):
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        return self.inner.multi_set(keys, values)  # type: ignore[attr-defined]


class Takeover:
    """One agent's side of the store takeover: its standby store, where the workers' store is now, the relay of
    its round's exit barrier, and (after a move, on the lowest surviving node) the endpoint probe."""

    def __init__(self):
        self.standby: dist.TCPStore | None = None  # served for the agent's whole life, empty until a takeover
        self.moved: dict | None = None  # the node whose standby store the workers (and the agents) moved to
        self.store_node = 0  # the node rank whose agent serves the workers' store now (a standby after a move)
        self.relay: Relay | None = None  # the store torch's exit barrier uses: node 0's, then the one moved to
        self.probe: EndpointProbe | None = None  # after a move: writes the running round into a node 0 come back

    def serve(self, addr: str) -> None:
        """This agent's standby store, on ``addr`` (once)."""
        if self.standby is None:
            self.standby = serve_store(addr, 0, READ_TIMEOUT_S)

    def relay_round(self, store: dist.Store) -> Relay:
        """The exit barrier's store of a new round (``store``, until the workers move theirs)."""
        self.relay = Relay(store)
        return self.relay

    def find(self, known: list[dict]) -> dict | None:
        """Which of the ``known`` nodes' standby stores the workers moved to (it holds the takeover claim); None:
        they did not (yet). Never the node that served the store."""
        for node in sorted(known, key=lambda n: n["node_rank"]):
            if node["node_rank"] != self.store_node and "standby" in node and holds(node["addr"], node["standby"],
                                                                                   INPLACE_TAKEOVER_KEY):
                return node
        return None

    def move_to(self, node: dict, exit_token: str) -> None:
        """Follow the workers to ``node``'s standby store: the exit barrier meets there, under ``exit_token``."""
        self.moved, self.store_node = node, node["node_rank"]
        if self.relay is not None:
            self.relay.move(dist.PrefixStore(f"lockstep/exit/{exit_token}", connect(node["addr"], node["standby"], 10)))

    def start_probe(self, endpoint: tuple[str, int], key: str, record: Callable[[], dict]) -> None:
        """Knock at node 0's endpoint; a store there again gets the running round (``record()``) at ``key``."""
        self.probe = EndpointProbe(endpoint, key, record)
        self.probe.start()

    def stop_probe(self) -> None:
        if self.probe is not None:
            self.probe.stop.set()
        self.probe = None
