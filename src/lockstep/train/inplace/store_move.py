"""Moving the store: the workers' store a rank talks to, the standby stores it may move to, and the quorum after.

The store itself may go (node 0's agent serves it). Every agent serves a standby store (``keys.INPLACE_STORES_ENV``
lists them): a survivor whose store calls fail moves to the standby store of the lowest node among the members'
nodes but the store's own, claiming it for its generation (``keys.INPLACE_TAKEOVER_KEY``, a compare-and-set), so no
two stores serve one generation; the survivors re-form there, and go on only with the majority rule of
``may_go_on_without_store`` (docs/preemptible.md, "Losing node 0"). The launcher's agents look for the same claim to
follow the workers (launch/rendezvous.py).
"""

from __future__ import annotations

import datetime
import json
import os

import torch.distributed as dist

from lockstep.keys import INPLACE_ACCEPTS_JOINS_KEY, INPLACE_BASE_KEY, INPLACE_STORES_ENV, INPLACE_TAKEOVER_KEY
from lockstep.network import accepts

STORE_TIMEOUT_S = 60.0  # a store call's timeout (and a client's connect, but for a standby's)
STANDBY_CONNECT_S = 2.0  # a standby store that does not take a connection this fast is not the successor


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


def stores_from_env(world_size: int) -> tuple[dict[int, tuple[str, int]], dict[int, int], int]:
    """``keys.INPLACE_STORES_ENV``: every node's standby store, the launch ranks on each node, the node serving
    the store."""
    raw = os.environ.get(INPLACE_STORES_ENV)
    if not raw:
        return {}, {}, 0
    spec = json.loads(raw)
    stores = {int(n["node_rank"]): (n["addr"], int(n["port"])) for n in spec["nodes"]}
    node_of = {int(r): int(n["node_rank"]) for n in spec["nodes"] for r in n["ranks"] if r < world_size}
    return stores, node_of, int(spec["store_node"])


def connect(host: str, port: int, connect_s: float = STORE_TIMEOUT_S) -> dist.TCPStore:
    """A client of the store at host:port; where ``connect_s`` is short, refused at once if nothing listens."""
    if connect_s < STORE_TIMEOUT_S and not accepts(host, port, connect_s):
        raise ConnectionRefusedError(f"nothing listens at {host}:{port}")  # no TCPStore retries (each logs)
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=connect_s), wait_for_workers=False)
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return store


class Stores:
    """The workers' store this rank talks to (``client``, at ``host:port``), and the standby stores it may move to.

    ``moves`` counts the moves: the watcher reconnects after one. ``next_id`` is the first id no process of this
    job ever had (newcomers take the next): a store moved to is told it, since its join count starts again."""

    def __init__(self, world_size: int):
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # node rank -> its standby store (addr, port); launch rank -> node rank; the node serving the store now
        self.standby, self.node_of, self.store_node = stores_from_env(world_size)
        self.next_id = world_size
        self.moved_at: int | None = None  # the generation whose re-formation moved the store (the quorum rule)
        self.moved_from: int | None = None  # the node that served the store before that move
        self.moves = 0
        self.client = connect(self.host, self.port)  # the main thread's

    def connect(self, connect_s: float = STORE_TIMEOUT_S) -> dist.TCPStore:
        """A client of its own (the watcher's: the main thread's may wait in a store call)."""
        return connect(self.host, self.port, connect_s)

    def learn(self, decision: dict) -> None:
        """The standby stores and nodes a grow decision (or a newcomer's admission) carries."""
        self.standby = {int(k): (str(v[0]), int(v[1])) for k, v in decision.get("stores", {}).items()}
        self.node_of = {int(k): int(v) for k, v in decision.get("node_of", {}).items()}
        self.store_node = decision.get("store_node", self.store_node)
        self.next_id = max(self.next_id, int(decision.get("next_id", 0)))

    def with_joined(self, joined: list[dict]) -> dict:
        """The standby stores and nodes after admitting ``joined`` (a returning node's agent serves a new one)."""
        stores = {str(k): list(v) for k, v in self.standby.items()}
        stores.update({str(r["node"]["node_rank"]): [r["node"]["addr"], r["node"]["standby"]]
                       for r in joined if "standby" in r["node"]})
        node_of = {**{str(k): v for k, v in self.node_of.items()},
                   **{str(r["id"]): r["node"]["node_rank"] for r in joined}}
        next_id = max([self.next_id, *(r["id"] + 1 for r in joined)])
        return {"stores": stores, "node_of": node_of, "store_node": self.store_node, "next_id": next_id}

    def find_standby(self, members: list[int], generation: int,
                     accepting: bool) -> tuple[int, str, int, dist.TCPStore] | None:
        """The store stopped answering: the standby store of the lowest node rank among the members' nodes but the
        store's own; every survivor computes the same list and takes the first that answers. The generation fences
        it: a store that took over for another generation is not used for this one. None where none answered (or
        this run has no standby stores: not under ``lockstep launch``). Changes nothing here (``move_to`` does)."""
        nodes = sorted({self.node_of[m] for m in members if m in self.node_of} - {self.store_node})
        claim = json.dumps({"generation": generation, "from": self.store_node})
        for node in nodes:
            if node not in self.standby:
                continue
            addr, port = self.standby[node]
            try:
                store = connect(addr, port, STANDBY_CONNECT_S)
                if store.compare_set(INPLACE_TAKEOVER_KEY, "", claim).decode() != claim:
                    continue  # it serves another generation: never two stores for one generation
                store.compare_set(INPLACE_BASE_KEY, "", str(self.next_id))  # newcomers' ids go on from here
                if accepting:
                    store.set(INPLACE_ACCEPTS_JOINS_KEY, "1")
            except Exception:  # its node is gone too
                continue
            return node, addr, port, store
        return None

    def move_to(self, found: tuple[int, str, int, dist.TCPStore], generation: int) -> None:
        """Talk to the standby store ``find_standby`` claimed from now on; its generation decides the quorum."""
        node, addr, port, store = found
        self.moved_from, self.moved_at = self.store_node, generation
        self.host, self.port, self.store_node, self.client = addr, port, node, store
        self.moves += 1

    def quorum(self, before: list[int], after: list[int], generation: int) -> bool:
        """Whether ``after`` may go on: always where the store stayed this generation (whoever it saw rejoin goes
        on), else the split-brain rule (``may_go_on_without_store``)."""
        if self.moved_at != generation:
            return True
        return may_go_on_without_store(before, after, self.node_of, self.moved_from)
