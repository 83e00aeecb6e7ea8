"""Hierarchical all-reduce for ranks that share nodes: sum inside the node, across nodes, then share inside.

On two nodes of two ranks joined by a slow link, the flat ring over 4 ranks (gloo's, in rank order) crosses the
link twice, once each way, and each crossing carries 2(N-1)/N = 1.5 x the buffer. Here the buffer is cut into one
chunk per local rank: local rank j receives the node's sum of chunk j (a reduce per chunk, inside the node), all-
reduces it with the local ranks j of the other nodes (one ring of M nodes per chunk, so the chunks cross the link in
parallel streams), and broadcasts it back inside the node. Each direction of the link then carries 2(M-1)/M x the
buffer: 1 x at two nodes, 2/3 of the flat ring's (the layout used by Horovod's and NCCL's hierarchical all-reduces).

The one idea: every group must see its collectives in the same order on every member, or gloo pairs them wrongly.
So each of the three stages has its own group (the node's group twice: one for the reduces, one for the broadcasts)
and its own thread, and each thread takes buckets strictly first in, first out: the stages pipeline across buckets
(bucket k crosses the link while bucket k+1 is summed inside the node) and each group's sequence is the submission
order on every rank. No stage is issued from a completion callback (torch's PowerSGD does that and aborts gloo with
several buckets). A failure in any stage is set on the bucket's future and every later bucket's, never a hang here.

The sums differ from the flat ring's in the order of the additions: (g0 + g1) + (g2 + g3) at 2 x 2 against the
ring's rotating chain, so at 4 ranks a float sum can differ in its last bits from the flat all-reduce's (every rank
still ends with the same bits: the owner's broadcast); a sum of two is the same either way (docs/ddp.md).
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.collectives.peers import chunk_bounds
from lockstep.process_group import on_shutdown

# Where a launcher says which node this rank is on: torchrun / lockstep launch (the agent's group), srun's tasks.
NODE_VARS = ("GROUP_RANK", "SLURM_NODEID")
_STOP = object()  # the sentinel a closing pipeline passes down its stages


@dataclass(frozen=True)
class NodeLayout:
    """Which global ranks share a node: ``nodes[n]`` lists node n's ranks, ascending; nodes in order of their id."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_node_ids(cls, node_ids: list[Any]) -> NodeLayout:
        """From each global rank's node id (rank order), as gathered."""
        members: dict[Any, list[int]] = {}
        for rank, node in enumerate(node_ids):
            members.setdefault(node, []).append(rank)
        return cls(tuple(tuple(members[n]) for n in sorted(members)))

    @property
    def ranks_per_node(self) -> int | None:
        """The ranks on each node where every node has as many, else None."""
        sizes = {len(n) for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def place(self, rank: int) -> tuple[int, int]:
        """``(node index, local index)`` of a global rank."""
        for n, members in enumerate(self.nodes):
            if rank in members:
                return n, members.index(rank)
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")

    def describe(self) -> str:
        return f"{len(self.nodes)} node(s) of {sorted({len(n) for n in self.nodes})} rank(s)"


def node_id_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """This rank's node index from the launcher's environment (``NODE_VARS``), or None where none is set."""
    env = os.environ if env is None else env
    for name in NODE_VARS:
        raw = env.get(name, "")
        if raw.strip():
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer (a node index)") from None
    return None


def flat_ring_link_nbytes(nbytes: int, layout: NodeLayout) -> int:
    """Bytes the flat ring (gloo's: rank r sends to r + 1, 2(N-1)/N of the buffer on each edge) puts on the busiest
    direction between two nodes, for an all-reduce of ``nbytes``."""
    world = sum(len(n) for n in layout.nodes)
    node_of = {r: n for n, members in enumerate(layout.nodes) for r in members}
    edges: dict[tuple[int, int], int] = {}
    for r in range(world):
        a, b = node_of[r], node_of[(r + 1) % world]
        if a != b:
            edges[(a, b)] = edges.get((a, b), 0) + 1
    return max(edges.values(), default=0) * 2 * (world - 1) * nbytes // world


def hierarchical_link_nbytes(nbytes: int, layout: NodeLayout) -> int:
    """Bytes this module puts on each direction between two neighbouring nodes for an all-reduce of ``nbytes``:
    every chunk's ring of M nodes carries 2(M-1)/M of it per edge, and the chunks add up to the buffer."""
    m = len(layout.nodes)
    return 2 * (m - 1) * nbytes // m if m > 1 else 0


class _Pipeline:
    """The three stage threads and their queues; owned by one ``HierarchicalAllReduce``, held by its threads (not
    the other way round, so a dropped owner closes it: ``weakref.finalize``)."""

    def __init__(self, node_reduce: Any, cross: Any, node_broadcast: Any, node_members: tuple[int, ...],
                 local_rank: int):
        # dist.reduce / broadcast (not the groups' own methods): a destroyed group then raises, at the waiter.
        self.node_members, self.local_rank, self.ranks_per_node = node_members, local_rank, len(node_members)
        self.groups = {"node_reduce": node_reduce, "cross": cross, "node_broadcast": node_broadcast}
        self.issued: dict[str, list[tuple[str, int]]] = {name: [] for name in self.groups}  # (op, numel) per group
        self.cross_nbytes = 0  # bytes this rank has all-reduced across nodes (its chunks)
        self.error: BaseException | None = None  # the first failure: every later bucket fails with it
        self.inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(3)]
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> None:
        stages: list[Callable[[torch.Tensor], None]] = [self._reduce, self._cross, self._broadcast]
        for i, stage in enumerate(stages):
            outbox = self.inboxes[i + 1] if i + 1 < len(stages) else None
            thread = threading.Thread(target=_run_stage, args=(self, stage, self.inboxes[i], outbox),
                                      name=f"lockstep-hierarchical-{stage.__name__.strip('_')}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def submit(self, tensor: torch.Tensor) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self.lock:
            if self.closed:  # no thread would ever take it: a hang at the waiter
                raise RuntimeError("lockstep hierarchical all-reduce: used after close() (or lockstep.shutdown())")
            if not self.threads:
                self.start()
            self.inboxes[0].put((tensor, future))
        return future

    def close(self, timeout_s: float = 1.0) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.threads:
                self.inboxes[0].put(_STOP)  # behind the buckets in flight: they finish first
        for thread in self.threads:
            thread.join(timeout_s)  # a stage stuck on a dead peer stays behind (a daemon: exit does not wait)

    def _chunks(self, tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        flat = tensor.view(-1)
        return [(i, flat[a:b]) for i, (a, b) in enumerate(chunk_bounds(flat.numel(), self.ranks_per_node)) if b > a]

    def _reduce(self, tensor: torch.Tensor) -> None:
        """Local rank i gets the node's sum of chunk i (the other ranks' copies of chunk i are left as scratch)."""
        group, works = self.groups["node_reduce"], []
        for i, chunk in self._chunks(tensor):
            self.issued["node_reduce"].append(("reduce", chunk.numel()))
            works.append(dist.reduce(chunk, self.node_members[i], group=group, async_op=True))
        for work in works:
            work.wait()

    def _cross(self, tensor: torch.Tensor) -> None:
        """This rank's chunk summed with the same chunk of every other node (one ring of M nodes)."""
        mine = dict(self._chunks(tensor)).get(self.local_rank)
        if mine is None:  # fewer elements than local ranks: this rank owns nothing
            return
        self.issued["cross"].append(("all_reduce", mine.numel()))
        self.cross_nbytes += mine.numel() * mine.element_size()
        work = dist.all_reduce(mine, group=self.groups["cross"], async_op=True)
        work.wait()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Each chunk from its owner to the node's other ranks."""
        group, works = self.groups["node_broadcast"], []
        for i, chunk in self._chunks(tensor):
            self.issued["node_broadcast"].append(("broadcast", chunk.numel()))
            works.append(dist.broadcast(chunk, self.node_members[i], group=group, async_op=True))
        for work in works:
            work.wait()


def _run_stage(pipeline: _Pipeline, stage: Callable[[torch.Tensor], None], inbox: queue.SimpleQueue,
               outbox: queue.SimpleQueue | None) -> None:
    """One stage's thread: buckets in submission order; a failure goes to the bucket's future, and every later
    bucket fails with it without issuing anything (the groups' sequences would no longer match across ranks)."""
    while True:
        item = inbox.get()
        if item is _STOP:
            if outbox is not None:
                outbox.put(_STOP)
            return
        tensor, future = item
        try:
            if pipeline.error is not None:
                raise RuntimeError(f"lockstep hierarchical all-reduce: an earlier bucket failed: {pipeline.error}")
            stage(tensor)
        except BaseException as e:  # everything reaches the waiter: a bare thread would only print it
            if pipeline.error is None:
                pipeline.error = e
            future.set_exception(e)
            continue
        if outbox is None:
            future.set_result(tensor)
        else:
            outbox.put(item)


_LIVE: weakref.WeakSet[HierarchicalAllReduce] = weakref.WeakSet()


def _close_all() -> None:
    for reducer in list(_LIVE):
        reducer.close()


class HierarchicalAllReduce:
    """In-place SUM of dense contiguous tensors over ``group`` (the world), inside nodes first (module docstring).

    Construction creates the subgroups (``dist.new_group``: every rank of the world must construct it, in the same
    order with the other groups it makes); the stage threads start with the first ``submit``. ``submit`` returns a
    ``torch.futures.Future`` that completes (or fails) when the tensor holds the sum; buckets must be submitted in
    the same order on every rank, as any collective.
    """

    def __init__(self, layout: NodeLayout, group: dist.ProcessGroup | None = None):
        per_node = layout.ranks_per_node
        if per_node is None or len(layout.nodes) < 2:
            raise ValueError(f"a hierarchical all-reduce needs several nodes of as many ranks each, got "
                             f"{layout.describe()}")
        self.layout, self.group = layout, group
        node, local_rank = layout.place(dist.get_rank())  # global: the layout's ranks
        # Every rank creates every group, in one order: new_group is collective over the world.
        node_reduce = [dist.new_group(list(members)) for members in layout.nodes]
        node_broadcast = [dist.new_group(list(members)) for members in layout.nodes]
        cross = [dist.new_group([members[j] for members in layout.nodes]) for j in range(per_node)]
        self.node, self.local_rank = node, local_rank
        self._pipeline = _Pipeline(node_reduce[node], cross[local_rank], node_broadcast[node], layout.nodes[node],
                                   local_rank)
        weakref.finalize(self, self._pipeline.close)
        if not _LIVE:
            on_shutdown(_close_all)  # lockstep.shutdown(): the threads stop before the groups go
        _LIVE.add(self)

    def submit(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start summing ``tensor`` (dense, contiguous) in place; the future's value is ``tensor``."""
        if not tensor.is_contiguous() or tensor.layout != torch.strided:
            raise ValueError("hierarchical all-reduce: the tensor must be dense and contiguous")
        if tensor.is_complex():  # reduce and broadcast take real dtypes only: the same memory, as pairs of reals
            future = self._pipeline.submit(torch.view_as_real(tensor))
            return future.then(lambda _: tensor)
        return self._pipeline.submit(tensor)

    @property
    def issued(self) -> dict[str, list[tuple[str, int]]]:
        """Per stage group (``node_reduce``, ``cross``, ``node_broadcast``): the (op, numel) issued, in order."""
        return self._pipeline.issued

    @property
    def cross_nbytes(self) -> int:
        """Bytes this rank has all-reduced with the other nodes so far (its own chunks)."""
        return self._pipeline.cross_nbytes

    def close(self) -> None:
        """Stop the stage threads once the buckets submitted so far are done (or after a second each)."""
        self._pipeline.close()


def hierarchy_for(group: dist.ProcessGroup, requested: bool | None, name: str,
                  env: Mapping[str, str] | None = None) -> HierarchicalAllReduce | None:
    """The hierarchical all-reduce for ``group`` as ``requested`` (``name``: the keyword, for errors), or None.

    None: on where the launcher's environment names this rank's node (``NODE_VARS``), ``group`` is the world on
    gloo, and there are several nodes of as many ranks each (at least two). True: the same, or a ValueError naming
    ``name`` and why not. False: None. Where the environment names nodes and not every rank is on one node, the
    node ids are gathered over the world (one collective, on every rank alike: the environment is the launcher's).
    """
    if not (requested is None or isinstance(requested, bool)):
        raise ValueError(f"{name} must be True, False or None, got {requested!r}")
    if requested is False:
        return None
    env = os.environ if env is None else env
    why = _why_flat(group, env)
    if why is None:
        # Every rank of the world is in ``group`` (checked): the node ids travel over the world, by global rank.
        node_ids: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(node_ids, node_id_from_env(env))
        layout = NodeLayout.from_node_ids(node_ids)
        if len(layout.nodes) >= 2 and (layout.ranks_per_node or 0) >= 2:
            return HierarchicalAllReduce(layout, group)
        why = f"it needs several nodes of as many ranks each (at least 2), the job has {layout.describe()}"
    if requested:
        raise ValueError(f"{name}=True: {why}")
    return None


def _why_flat(group: dist.ProcessGroup, env: Mapping[str, str]) -> str | None:
    """Why the environment and ``group`` alone rule the hierarchy out, with no collective; None: gather the layout."""
    world = dist.get_world_size()
    if group is not dist.group.WORLD and dist.get_world_size(group) != world:
        return "the all-reduce is over a process group other than the world; pass the default group"
    backend = dist.get_backend(group)
    if backend != "gloo":
        return f"only on gloo (the group's backend is {backend}; NCCL's own rings and trees know the nodes)"
    if node_id_from_env(env) is None:
        return (f"the node layout is unknown: none of {', '.join(NODE_VARS)} is set (lockstep launch, torchrun "
                "and srun set them)")
    if env.get("LOCAL_WORLD_SIZE", "") == str(world):
        return f"all {world} ranks are on one node (LOCAL_WORLD_SIZE={world})"
    return None
