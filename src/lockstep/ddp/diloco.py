"""DiLoCo: data parallelism across a slow link, by averaging every H inner steps instead of every step.

Each node trains on its own for ``sync_every`` (H) inner steps (inside a node, plain DDP on the node's fast group);
then the pseudo-gradient, the parameters of the last sync minus the current ones, is averaged across nodes by an
all-reduce in buckets, an outer optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9: Douillard et al. 2023,
"DiLoCo", arXiv:2311.08105) steps the synced copy with it as its gradient, and every replica copies the result back.
A link then carries the model's bytes once every H steps. Streaming (Douillard et al. 2025, "Streaming DiLoCo",
arXiv:2501.18512): the buckets are split into ``fragments``, fragment k is synced at steps k*H/fragments apart, and
its all-reduce is launched asynchronously and landed ``overlap_steps`` inner steps later, so the wire works while
the node computes and no single sync carries the whole model.

The one idea: the synced copy (``anchors``: one flat fp32 tensor a bucket) is the state every replica agrees on,
and it is the outer optimizer's parameter: the optimizer steps a few large flat tensors (its foreach kernels run
once a bucket) and its state lines up with the buckets, which is what a checkpoint stores. torchft's ``DiLoCo``
(a CPU backup of the parameters, one all-reduce a parameter) is the reference this departs from in the buckets.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lockstep.diagnostics.progress import ProgressObserver

MIB = 1024 * 1024
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class OuterObserver(Protocol):
    """What DiLoCo says of its waits (``diagnostics.progress.ProgressObserver`` takes it): the hang watchdog's report
    then names the outer all-reduce, or the node's broadcast, that a rank is stuck in."""

    def outer_wait(self, fragment: int, bucket: int, buckets: int, launched_at: int, inner_step: int,
                   op: str) -> None: ...
    def outer_end(self) -> None: ...


class OuterSyncError(RuntimeError):
    """The outer all-reduce failed or timed out (a peer left or hangs): the message names the fragment, the
    bucket and the inner step it was launched at, never a silent hang."""


@dataclass(frozen=True)
class DiLoCoConfig:
    """How DiLoCo syncs; validated here, the one place (a bad value fails at construction, naming the field)."""

    sync_every: int
    """H: inner steps between two syncs of each fragment (DiLoCo's paper: 500 on C4; 1 is data parallelism)."""
    outer_lr: float = 0.7
    """The default outer optimizer's learning rate (SGD; the paper's 0.7)."""
    outer_momentum: float = 0.9
    """The default outer optimizer's momentum (0: plain SGD; the paper's 0.9)."""
    nesterov: bool = True
    """Nesterov momentum for the default outer optimizer (needs outer_momentum > 0)."""
    wire_dtype: str = "fp32"
    """How the pseudo-gradients cross the link: "fp32", "bf16" or "fp16" (half the bytes); averaged in fp32 after."""
    fragments: int = 1
    """Groups of buckets synced at staggered steps (streaming when > 1): consecutive parameters of about equal
    elements each, at most one a parameter tensor."""
    overlap_steps: int | None = None
    """Inner steps between a fragment's all-reduce launch and its landing (the overlap). None: 0 with one fragment
    (a blocking sync), 1 when streaming. Must be < sync_every // fragments, so a fragment lands before the next
    one launches."""
    bucket_cap_mb: float = 25.0
    """The cap of one bucket of the outer all-reduce, MiB of fp32 pseudo-gradient (a parameter is never split)."""
    timeout_s: float | None = None
    """How long a wait for the outer all-reduce may take before OuterSyncError; None: the process group's timeout."""
    warmup_steps: int = 0
    """Inner steps of synchronous training first: after each of them the parameters are averaged across nodes
    (an outer step of lr 1.0 without momentum, DDP's bytes every step), then the outer loop starts, its first sync
    ``sync_every`` steps later. DiLoCo's paper starts from a model pretrained synchronously (24k of 88k steps):
    from scratch the replicas move far apart in the first steps, where the loss falls fastest, and the outer
    momentum then carries the early disagreement along."""

    def __post_init__(self) -> None:
        for name in ("sync_every", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DiLoCoConfig.{name} must be an int >= 1, got {value!r}")
        warmup = self.warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"DiLoCoConfig.warmup_steps must be an int >= 0, got {warmup!r}")
        if self.fragments > self.sync_every:
            raise ValueError(f"DiLoCoConfig.fragments={self.fragments} must be <= sync_every={self.sync_every}: "
                             f"each fragment syncs at its own inner step")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"DiLoCoConfig.wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        for name in ("outer_lr", "outer_momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"DiLoCoConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("DiLoCoConfig.nesterov=True needs outer_momentum > 0 (or pass nesterov=False)")
        overlap = self.overlap_steps
        if overlap is not None and (isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0):
            raise ValueError(f"DiLoCoConfig.overlap_steps must be None or an int >= 0, got {overlap!r}")
        if self.overlap >= max(1, self.sync_every // self.fragments):
            raise ValueError(f"DiLoCoConfig.overlap_steps={self.overlap} must be < sync_every // fragments = "
                             f"{self.sync_every // self.fragments}: a fragment must land before the next launches")
        if isinstance(self.bucket_cap_mb, bool) or not (isinstance(self.bucket_cap_mb, (int, float))
                                                         and self.bucket_cap_mb > 0):
            raise ValueError(f"DiLoCoConfig.bucket_cap_mb must be a number > 0, got {self.bucket_cap_mb!r}")
        if self.timeout_s is not None and (isinstance(self.timeout_s, bool) or not (
                isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0)):
            raise ValueError(f"DiLoCoConfig.timeout_s must be None or a number > 0, got {self.timeout_s!r}")

    @property
    def overlap(self) -> int:
        """``overlap_steps`` resolved: 0 with one fragment, 1 when streaming, unless set."""
        if self.overlap_steps is not None:
            return self.overlap_steps
        return 0 if self.fragments == 1 else 1

    def offset(self, fragment: int) -> int:
        """The inner step (mod H) at which ``fragment`` launches: fragment k at k*H/fragments (fragment 0 at H)."""
        return fragment * self.sync_every // self.fragments

    def launches_at(self, inner_step: int) -> list[int]:
        """The fragments whose all-reduce launches after inner step ``inner_step`` (counted from 1); none in the
        warm-up, whose steps each average every parameter (``averages_at``), and the schedule starts after it."""
        step = inner_step - self.warmup_steps
        return [k for k in range(self.fragments)
                if step > 0 and step >= self.offset(k) and (step - self.offset(k)) % self.sync_every == 0]

    def averages_at(self, inner_step: int) -> bool:
        """Whether inner step ``inner_step`` is one of the warm-up's, after which the parameters are averaged."""
        return inner_step <= self.warmup_steps


# -- pure helpers: buckets and fragments ------------------------------------------------------------
def assign_buckets(numels: list[int], cap_numel: int) -> list[list[int]]:
    """Parameter indices in order, cut into buckets of at most ``cap_numel`` elements (a larger parameter alone)."""
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        if not buckets or size + n > cap_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def assign_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Indices (of parameters) cut into ``fragments`` consecutive groups of about equal elements, none empty."""
    total, done = sum(numels), 0
    out: list[list[int]] = [[]]
    for b, n in enumerate(numels):
        to_open = fragments - len(out)
        # the next fragment starts where this index's middle lies past this one's share, or when each one left
        # needs an index of its own
        if out[-1] and to_open and (len(numels) - b <= to_open or (2 * done + n) * fragments >= 2 * len(out) * total):
            out.append([])
        out[-1].append(b)
        done += n
    return out


@dataclass
class SyncRecord:
    """One landed fragment: what the progress bar and the metrics show."""

    fragment: int
    launched_at: int
    """The inner step after which its pseudo-gradient was taken."""
    landed_at: int
    """The inner step after which the outer step was applied (``launched_at + overlap``)."""
    seconds: float
    """Time the training loop spent in this sync (preparing, waiting for the wire, the outer step, the copy back):
    what it cost the step, not the all-reduce's own duration where it overlapped inner steps."""
    wire_nbytes: int
    """Bytes of the buffers this rank all-reduced (numel x the wire dtype's size)."""


@dataclass
class _InFlight:
    """A launched fragment, until it lands: its works, then (once waited for) its averaged pseudo-gradients."""

    fragment: int
    launched_at: int
    wires: list[torch.Tensor]
    works: list[dist.Work | None]
    seconds: float = 0.0
    averaged: list[torch.Tensor] | None = field(default=None)
    buffers: list[torch.Tensor] | None = field(default=None)  # fragment 0's: rank 0's floating buffers


class DiLoCo:
    """The outer loop of DiLoCo around a model that trains on its own (a plain module, or a DDP on the node's group).

    Call ``step()`` after every inner optimizer step; it launches, waits for and applies the outer syncs when due.

    Args:
        model: the module whose parameters (those that require grad) are synced; every rank of ``group`` must build
            the same one.
        config: a DiLoCoConfig.
        group: the ranks that sync across nodes (default: the world, one rank a node). With several ranks a node,
            the ranks with the same local index on every node (``node_groups``).
        node_group: the ranks of this node (their parameters equal: a DDP on it); None: one rank a node. Each
            bucket crosses the link from one of them (local index = bucket index mod ranks a node) and is shared
            inside the node after, so the link carries each byte once.
        outer_optimizer: builds the outer optimizer on the flat synced buckets (``params -> Optimizer``); default
            SGD(outer_lr, outer_momentum, nesterov) from the config. Any torch optimizer: it sees one parameter a
            bucket, so per-parameter groups do not carry over.
        init_sync: broadcast rank 0's parameters and buffers first, so every replica starts alike (as DDP does).
    """

    def __init__(self, model: nn.Module, config: DiLoCoConfig, *, group: dist.ProcessGroup | None = None,
                 node_group: dist.ProcessGroup | None = None, outer_optimizer: OuterOptimizerFactory | None = None,
                 init_sync: bool = True):
        if not isinstance(config, DiLoCoConfig):
            raise TypeError(f"DiLoCo: config must be a DiLoCoConfig, got {type(config).__name__}")
        self.model, self.config, self.group, self.node_group = model, config, group, node_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo: the model has no parameter that requires grad")
        if any(not p.is_floating_point() for p in self.params):
            raise ValueError("DiLoCo: every parameter that requires grad must be floating point")
        self.world_size = dist.get_world_size(group)
        self.local_rank = dist.get_rank(node_group) if node_group is not None else 0
        self.local_size = dist.get_world_size(node_group) if node_group is not None else 1
        if config.fragments > len(self.params):
            raise ValueError(f"DiLoCoConfig.fragments={config.fragments} is more than the {len(self.params)} "
                             f"parameter tensors of this model: a fragment holds whole parameters")
        # fragments first (consecutive parameters, about equal elements), then each cut into buckets: a fragment
        # is a group of buckets, whatever the cap
        cap_numel = max(1, int(config.bucket_cap_mb * MIB) // 4)  # fp32 elements
        numels = [p.numel() for p in self.params]
        self.buckets: list[list[int]] = []  # parameter indices, in model order
        self.fragments: list[list[int]] = []  # bucket indices
        for members in assign_fragments(numels, config.fragments):
            cut = assign_buckets([numels[i] for i in members], cap_numel)
            self.fragments.append(list(range(len(self.buckets), len(self.buckets) + len(cut))))
            self.buckets += [[members[j] for j in bucket] for bucket in cut]
        # The synced copy lives where the all-reduce reads: gloo sends from host memory, so on CPU the anchors
        # cost no extra copy on the wire and keep 3 x the parameters (anchor, outer momentum, pseudo-gradient)
        # out of accelerator memory, as torchft's CPU backup does; a sync then copies the parameters over PCIe
        # once each way (~10 ms a GB), every H steps. NCCL reads device memory: there they stay on the device.
        backend = dist.get_backend(group)
        self.device = self.params[0].device if backend != "gloo" else torch.device("cpu")
        if init_sync:
            self._broadcast_start()
        with torch.no_grad():
            self.anchors = [torch.cat([self.params[i].detach().reshape(-1).to(self.device, torch.float32)
                                       for i in b]) for b in self.buckets]
        # the pseudo-gradients, one buffer a bucket: all-reduced in place on an fp32 wire, the outer step's .grad
        self.deltas = [torch.zeros_like(a) for a in self.anchors]
        factory = outer_optimizer or self._default_outer
        self.outer_optimizer = factory(self.anchors)
        self.inner_step = 0
        self.in_flight: list[_InFlight] = []
        self._due: list[_InFlight] = []  # completed by ``exchange``, landed by ``apply``
        self.synced_at: int | None = 0  # the inner step at which the parameters were last all their anchors
        self.last_sync: SyncRecord | None = None
        self.wire_nbytes = 0  # bytes all-reduced by this rank so far (this rank's buckets only, with node groups)
        # The process's progress record, which the hang watchdog (started by a DDP: the Trainer's, the node's) reads:
        # a rank stuck in the outer all-reduce is reported as such within hang_timeout_s, not only by OuterSyncError
        # when timeout_s is set. A few attribute writes a bucket, every H steps; nobody reads them without a watchdog.
        self.observer: OuterObserver = ProgressObserver(lambda: None)

    def _default_outer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.SGD(params, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[SyncRecord]:
        """After one inner optimizer step: launch the fragments due, land those whose overlap is over; returns the
        syncs landed here (usually none). Every rank of ``group`` must call it after every inner step.
        ``exchange()`` then ``apply()``: a loop that commits its steps (in-place recovery) calls the two apart."""
        self.exchange()
        return self.apply()

    def exchange(self) -> None:
        """The communicating half of ``step``: launch the fragments due, wait for those due to land (and the
        buffers' broadcast with fragment 0). Changes no parameter and no anchor: a loop that fails here, or in a
        commit between the halves, is still at its last sync (``at_sync_point``)."""
        self.inner_step += 1
        if self.config.averages_at(self.inner_step):  # the warm-up: DDP's bytes, every step, blocking
            self._due = [self._launch(k) for k in range(len(self.fragments))]
            for flight in self._due:
                self._complete(flight)
            return
        for k in self.config.launches_at(self.inner_step):
            self.in_flight.append(self._launch(k))
        while self.in_flight and self.in_flight[0].launched_at + self.config.overlap <= self.inner_step:
            flight = self.in_flight.pop(0)
            self._complete(flight)
            self._due.append(flight)

    def apply(self) -> list[SyncRecord]:
        """The local half of ``step``: the outer steps of the fragments ``exchange`` completed, copied into the
        parameters (no communication)."""
        average = self.config.averages_at(self.inner_step)
        landed = [self._land(flight, average) for flight in self._due]
        self._due = []
        if (len(self.fragments) == 1 and landed) or average:  # every parameter is its anchor again
            self.synced_at = self.inner_step
        return landed

    @property
    def at_sync_point(self) -> bool:
        """Every parameter equals its anchor and nothing is in flight: the state every replica agrees on (after a
        sync of the whole model, the warm-up's averages, the start, ``reset_to_global``). Never between two
        fragments' syncs of a streaming DiLoCo."""
        return self.synced_at == self.inner_step and not self.in_flight and not self._due

    def sync(self) -> list[SyncRecord]:
        """Every fragment now, landed now (an end of training, or an evaluation of the agreed model); in flight ones
        land first. A collective: every rank must call it at the same inner step."""
        landed = [self._land(self.in_flight.pop(0)) for _ in range(len(self.in_flight))]
        for k in range(len(self.fragments)):
            landed.append(self._land(self._launch(k)))
        self.synced_at = self.inner_step
        return landed

    def _launch(self, k: int) -> _InFlight:
        """Fragment k's pseudo-gradients (anchor - current) / nodes, cast to the wire, their all-reduces started."""
        t0 = time.perf_counter()
        wires: list[torch.Tensor] = []
        works: list[dist.Work | None] = []
        wire_dtype = WIRE_DTYPES[self.config.wire_dtype]
        with torch.no_grad():
            for b in self.fragments[k]:
                delta = self.deltas[b]
                self._gather_params(b, delta)  # a device-to-host copy per parameter on CUDA with gloo
                torch.sub(self.anchors[b], delta, out=delta)
                # divided before the sum: fp16's range (torch's fp16_compress_hook does the same); 1/nodes is exact
                # in binary only for powers of two, one rounding otherwise
                delta.div_(self.world_size)
                wire = delta if wire_dtype == torch.float32 else delta.to(wire_dtype)
                mine = b % self.local_size == self.local_rank  # with node groups: one rank of the node sends it
                # buckets launch in index order on every rank: gloo pairs collectives by their order in the group
                works.append(dist.all_reduce(wire, group=self.group, async_op=True) if mine else None)
                if mine:
                    self.wire_nbytes += wire.numel() * wire.element_size()
                wires.append(wire)
        return _InFlight(k, self.inner_step, wires, works, time.perf_counter() - t0)

    def _gather_params(self, b: int, out: torch.Tensor) -> None:
        offset = 0
        for i in self.buckets[b]:
            p = self.params[i]
            out[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()

    def _complete(self, flight: _InFlight) -> None:
        """Wait for a fragment's all-reduces (and the node's broadcasts); its averages kept in fp32."""
        if flight.averaged is not None:
            return
        t0 = time.perf_counter()
        timeout = None if self.config.timeout_s is None else datetime.timedelta(seconds=self.config.timeout_s)
        buckets = self.fragments[flight.fragment]
        for j, (b, wire, work) in enumerate(zip(buckets, flight.wires, flight.works)):
            said = (flight.fragment, j + 1, len(buckets), flight.launched_at, self.inner_step)
            try:
                if work is not None:
                    self.observer.outer_wait(*said, "all-reduce")
                    work.wait() if timeout is None else work.wait(timeout)
                if self.node_group is not None and self.local_size > 1:  # shared inside the node, the fast link
                    src = dist.get_global_rank(self.node_group, b % self.local_size)
                    self.observer.outer_wait(*said, "broadcast")
                    dist.broadcast(wire, src=src, group=self.node_group)
            except RuntimeError as e:  # gloo's timeout, a peer gone (DistBackendError is a RuntimeError)
                raise OuterSyncError(
                    f"DiLoCo: the outer all-reduce of fragment {flight.fragment} (bucket {j + 1} of {len(buckets)}, "
                    f"launched after inner step {flight.launched_at}) failed after "
                    f"{time.perf_counter() - t0:.1f} s: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                ) from e  # the phase stays "outer": a report at exit names this wait
        self.observer.outer_end()
        flight.averaged = [w if w.dtype == torch.float32 else w.float() for w in flight.wires]
        if flight.fragment == 0:
            flight.buffers = self._broadcast_buffers()
        flight.seconds += time.perf_counter() - t0

    def _land(self, flight: _InFlight, average: bool = False) -> SyncRecord:
        """The outer step on fragment k's anchors with the averaged pseudo-gradients, copied into the parameters.
        ``average`` (the warm-up): anchor - mean(anchor - current), the replicas' mean, without the outer
        optimizer (its momentum starts with the outer loop)."""
        self._complete(flight)
        t0 = time.perf_counter()
        assert flight.averaged is not None
        buckets = self.fragments[flight.fragment]
        with torch.no_grad():
            if average:
                for b, averaged in zip(buckets, flight.averaged):
                    self.anchors[b].sub_(averaged)
            else:
                for b, averaged in zip(buckets, flight.averaged):
                    self.anchors[b].grad = averaged
                self.outer_optimizer.step()  # the other fragments' anchors have no .grad: torch's optimizers skip them
            for b in buckets:
                self.anchors[b].grad = None
                self._scatter_params(b, self.anchors[b])
        for buf, value in zip(self._float_buffers(), flight.buffers or []):
            buf.copy_(value)
        nbytes = sum(w.numel() * w.element_size() for w, work in zip(flight.wires, flight.works) if work is not None)
        record = SyncRecord(flight.fragment, flight.launched_at, self.inner_step,
                            flight.seconds + time.perf_counter() - t0, nbytes)
        self.last_sync = record
        return record

    def _scatter_params(self, b: int, source: torch.Tensor) -> None:
        offset = 0
        for i in self.buckets[b]:
            p = self.params[i]
            p.detach().copy_(source[offset:offset + p.numel()].view_as(p))  # host-to-device on CUDA with gloo
            offset += p.numel()

    # -- start-up and buffers -------------------------------------------------------------------------
    def _root(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def _broadcast_from_root(self, tensors: list[torch.Tensor]) -> None:
        """Global rank 0's ``tensors`` on every rank: across nodes from the ranks of local index 0 (their cross
        group holds global rank 0), then inside each node from that rank. Not each cross group from node 0's rank of
        its own index: that rank may hold other values (a DiLoCo built before the node's DDP broadcast; BatchNorm's
        running statistics, each from its rank's own batch), and a node's ranks would then disagree. Each byte
        crosses the link once; the node's broadcast is one more on the fast link."""
        with torch.no_grad():
            if self.local_rank == 0:
                for t in tensors:
                    dist.broadcast(t, src=self._root(), group=self.group)
            if self.node_group is not None and self.local_size > 1:
                src = dist.get_global_rank(self.node_group, 0)
                for t in tensors:
                    dist.broadcast(t, src=src, group=self.node_group)

    def _broadcast_start(self) -> None:
        self._broadcast_from_root([p.detach() for p in self.params])
        with torch.no_grad():
            for buf, value in zip(self._float_buffers(), self._broadcast_buffers()):
                buf.copy_(value)

    def _float_buffers(self) -> list[torch.Tensor]:
        return [buf for buf in self.model.buffers() if buf.is_floating_point()]

    def _broadcast_buffers(self) -> list[torch.Tensor]:
        """Floating buffers (BatchNorm's statistics) of global rank 0, at each full cycle (fragment 0's sync, as
        DDP broadcasts them each forward): one small blocking collective a buffer (two with node groups), into
        copies that the landing puts in the model (the exchange changes nothing of it)."""
        copies = [buf.detach().clone() for buf in self._float_buffers()]
        self._broadcast_from_root(copies)
        return copies

    # -- the agreed model ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def global_parameters(self) -> Iterator[None]:
        """The parameters of the last sync in the model for the block (an evaluation of the model every replica
        agrees on), this replica's own after; no communication, two copies of the parameters."""
        saved = [p.detach().clone() for p in self.params]
        try:
            self.reset_to_global()
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    def reset_to_global(self) -> None:
        """Set the model's parameters to the last synced ones: where a replica that lost its own (a resume at
        another world size, a node that joins) starts from."""
        with torch.no_grad():
            for b, anchor in enumerate(self.anchors):
                self._scatter_params(b, anchor)
        if not self.in_flight and not self._due:
            self.synced_at = self.inner_step

    # -- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What the next syncs depend on besides the model and inner optimizer: the inner step, the synced copy,
        the outer optimizer's state and the fragments in flight (waited for here, their averages kept: they land
        at the same step as without the checkpoint). The same on every rank of the group."""
        for flight in self.in_flight:
            self._complete(flight)
        return {"inner_step": self.inner_step, "bucket_numels": [a.numel() for a in self.anchors],
                "fragments": [list(f) for f in self.fragments], "sync_every": self.config.sync_every,
                "warmup_steps": self.config.warmup_steps,
                "anchors": [a.detach().clone() for a in self.anchors],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "in_flight": [{"fragment": f.fragment, "launched_at": f.launched_at,
                               "averaged": [a.clone() for a in f.averaged or []],
                               "buffers": [b.clone() for b in f.buffers or []]} for f in self.in_flight],
                "wire_nbytes": self.wire_nbytes}

    def load_state_dict(self, state: dict) -> None:
        """Take a ``state_dict`` (of any world size: it is the same on every rank); the model's parameters are not
        touched (``reset_to_global`` for a replica that starts from the synced copy)."""
        numels = [a.numel() for a in self.anchors]
        if state["bucket_numels"] != numels or state["fragments"] != self.fragments:
            raise ValueError(f"DiLoCo.load_state_dict: the state's buckets {state['bucket_numels']} in fragments "
                             f"{state['fragments']} differ from this DiLoCo's {numels} in {self.fragments}: the same "
                             f"model, bucket_cap_mb and fragments are needed")
        warmup = state.get("warmup_steps", 0)
        if warmup != self.config.warmup_steps:
            raise ValueError(f"DiLoCo.load_state_dict: the state was saved with DiLoCoConfig.warmup_steps={warmup}, "
                             f"this DiLoCo has {self.config.warmup_steps}: the outer schedule would shift")
        if self.in_flight:
            raise ValueError("DiLoCo.load_state_dict: fragments of this DiLoCo are in flight; load before training")
        with torch.no_grad():
            for anchor, saved in zip(self.anchors, state["anchors"]):
                anchor.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_step, self.wire_nbytes = state["inner_step"], state.get("wire_nbytes", 0)
        self.in_flight = [_InFlight(f["fragment"], f["launched_at"], [a.to(self.device) for a in f["averaged"]],
                                    [None] * len(f["averaged"]), averaged=[a.to(self.device) for a in f["averaged"]],
                                    buffers=f.get("buffers"))
                          for f in state["in_flight"]]
        self.synced_at = None  # the model's parameters are the caller's to load (or ``reset_to_global``)

    # -- in-place recovery (train/diloco.py: the Trainer's side) -----------------------------------------
    def position(self) -> dict:
        """At a sync point, what ``rewind`` needs besides the anchors and the outer optimizer (which change only
        when a sync lands, so a loop that snapshots at each sync point holds them already): a few numbers."""
        if not self.at_sync_point:
            raise RuntimeError("DiLoCo.position: only at a sync point (at_sync_point), where every parameter is "
                               "its anchor")
        return {"inner_step": self.inner_step, "wire_nbytes": self.wire_nbytes, "last_sync": self.last_sync}

    def rewind(self, saved: dict) -> None:
        """Back to where ``saved`` was taken, what is in flight dropped (its all-reduce failed, or belongs to a group
        that is gone); no communication. ``saved``: a ``position()`` (the parameters set to the anchors), or a
        ``state_dict()`` taken off a sync point (the caller puts back the parameters it saved with it)."""
        self.in_flight, self._due = [], []
        if "anchors" in saved:
            self.load_state_dict(saved)
            return
        self.inner_step, self.wire_nbytes = saved["inner_step"], saved["wire_nbytes"]
        self.last_sync = saved["last_sync"]
        self.reset_to_global()

    def regroup(self, group: dist.ProcessGroup | None, node_group: dist.ProcessGroup | None) -> None:
        """Sync over new groups (the world re-formed in place: a node lost or admitted); nothing in flight."""
        if self.in_flight or self._due:
            raise RuntimeError("DiLoCo.regroup: fragments are in flight on the old group; rewind first")
        self.group, self.node_group = group, node_group
        self.world_size = dist.get_world_size(group)
        self.local_rank = dist.get_rank(node_group) if node_group is not None else 0
        self.local_size = dist.get_world_size(node_group) if node_group is not None else 1


def node_groups(group_world: dist.ProcessGroup | None = None, node_ids: list[int] | None = None
                ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(node_group, group)`` for DiLoCo: this rank's node, and the ranks of its local index on every node.

    ``node_ids``: each global rank's node (rank order); default: gathered from the launcher's environment
    (GROUP_RANK / SLURM_NODEID, ``collectives.hierarchical``), every rank a node of its own where none is set.
    One rank a node: ``(None, None)`` (the world). A collective: every rank calls it, in the same order with its
    other ``new_group`` calls."""
    from lockstep.collectives.hierarchical import NodeLayout, node_id_from_env

    if node_ids is None:
        gathered: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, node_id_from_env())
        node_ids = [r if n is None else n for r, n in enumerate(gathered)]
    layout = NodeLayout.from_node_ids(list(node_ids))
    per_node = layout.ranks_per_node
    if per_node is None:
        raise ValueError(f"DiLoCo node groups need as many ranks on every node, got {layout.describe()}")
    if per_node == 1:
        return None, None
    node, local = layout.place(dist.get_rank())
    nodes = [dist.new_group(list(members)) for members in layout.nodes]  # every rank makes every group, in order
    cross = [dist.new_group([members[j] for members in layout.nodes]) for j in range(per_node)]
    return nodes[node], cross[local]
