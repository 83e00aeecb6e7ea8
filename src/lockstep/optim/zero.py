"""ZeRO stage 1: each rank keeps the optimizer state of a shard of the parameters, steps that shard, and the
updated parameters are sent to every rank. torch's ``ZeroRedundancyOptimizer`` API, written for lockstep.

The one idea: the parameters are partitioned across ranks exactly as torch partitions them (per parameter group,
largest first, each to the rank with the fewest elements so far), so a rank's shard, its local optimizer and the
consolidated ``state_dict`` are the ones torch's class gives, and a checkpoint moves between the two. What differs
is how the updated parameters travel: torch broadcasts every parameter from its owner (or, with
``parameters_as_bucket_view``, one flat bucket a rank); here a parameter of ``DIRECT_BYTES`` or more is broadcast in
place, and the smaller ones of a rank go together, up to ``COALESCE_BYTES`` a broadcast (the same bits, in fewer
collectives for a model of many small tensors). Broadcasts, not all-gathers: on gloo an all-gather of the same bytes
took 3x as long on loopback (it stages through a buffer of the whole output and copies out; a broadcast sends from
and receives into the tensor itself), and it needs that buffer.

Memory, fp32 with Adam at N ranks: parameters 4 + gradients 4 + optimizer state 8/N bytes a parameter, plus at most
``COALESCE_BYTES`` of small parameters in flight where ``parameters_as_bucket_view=False`` (with ``True`` they are
views of one flat buffer a device, broadcast a rank's part at a time, in place).
``overlap_with_ddp=True`` is refused: torch supports it on NCCL only, through a comm hook of its own DDP
(``ddp_zero_hook``); docs/zero.md says what to use instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

# A parameter this large is broadcast alone, from and into its own storage; smaller ones of the same rank are copied
# into one buffer of at most COALESCE_BYTES a broadcast (a collective costs ~50-100 us on gloo whatever its size, and
# a transformer has hundreds of small tensors). What is in flight in buffers stays under COALESCE_BYTES x 2.
DIRECT_BYTES = 1 * 2**20
COALESCE_BYTES = 4 * 2**20


def partition_parameters(param_groups: list[dict[str, Any]], world_size: int) -> list[list[list[torch.Tensor]]]:
    """``[rank][group] -> parameters``: torch's sorted-greedy partition (``ZeroRedundancyOptimizer``'s).

    Per group in order, the parameters largest first (a stable sort: ties keep their order), each to the rank that
    holds the fewest elements so far (the lowest rank on a tie); the counts carry over from group to group. Frozen
    parameters are counted too, as torch counts them, so the shards do not move when trainability changes.

    Each rank's list keeps the group's order, where torch's keeps the sorted one: the same shards and the same
    whole-optimizer ``state_dict``, but a for-loop optimizer then steps the large parameters between the small ones
    as in the model, and holds one large parameter's temporaries at a time (Adam's ``denom`` of the last parameter
    lives until the next one's is computed: two of the largest in a row cost a third temporary, +50% of the step's).
    """
    sizes = [0] * world_size
    out: list[list[list[torch.Tensor]]] = [[] for _ in range(world_size)]
    for group in param_groups:
        owner: dict[int, int] = {}  # id(param) -> rank
        for param in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            owner[id(param)] = rank
            sizes[rank] += param.numel()
        for rank in range(world_size):
            out[rank].append([p for p in group["params"] if owner[id(p)] == rank])
    return out


@dataclass
class _Segment:
    """One device's trainable parameters: rank r's ``shards[r]`` and how they travel, ``runs[r]`` (each a list of
    parameters broadcast together; alone where large). With bucket views ``storage`` holds every rank's shard end to
    end (rank r's at ``r * numel``) and the parameters view it: one broadcast a rank."""

    shards: list[list[torch.Tensor]]
    runs: list[list[list[torch.Tensor]]]
    numel: int
    storage: torch.Tensor | None = None


def _runs(shard: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A rank's shard as broadcasts: each large contiguous parameter alone, then the others in order, grouped up to
    COALESCE_BYTES (a model's biases and norms between its weights go together). Computed from shapes and layouts
    alone, so alike on every rank."""
    runs: list[list[torch.Tensor]] = []
    small: list[list[torch.Tensor]] = []
    size = COALESCE_BYTES  # no open group
    for p in shard:
        nbytes = p.numel() * p.element_size()
        if nbytes >= DIRECT_BYTES and p.data.is_contiguous():
            runs.append([p])
            continue
        if size + nbytes > COALESCE_BYTES:
            small.append([])
            size = 0
        small[-1].append(p)
        size += nbytes
    return runs + small


def build_segment(shards: list[list[torch.Tensor]], world_size: int, as_bucket_view: bool) -> _Segment | None:
    """How one device's trainable parameters, ``shards[rank]`` in shard order, travel; the same on every rank.
    With bucket views the parameters become views of the segment's storage (their values copied in)."""
    every = [p for shard in shards for p in shard]
    if not every:
        return None
    numel = max(sum(p.numel() for p in shard) for shard in shards)
    segment = _Segment(shards, [_runs(shard) for shard in shards], numel)
    if as_bucket_view:
        segment.storage = torch.zeros(world_size * numel, dtype=every[0].dtype, device=every[0].device)
        for rank, shard in enumerate(shards):
            offset = rank * numel
            for p in shard:
                view = segment.storage[offset:offset + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
    return segment


def _pack(run: list[torch.Tensor], buffer: torch.Tensor, into_params: bool) -> None:
    """A run's parameters from or into ``buffer``, end to end (a non-contiguous parameter too)."""
    offset = 0
    for p in run:
        view = buffer[offset:offset + p.numel()].view(p.shape)
        if into_params:
            p.data.copy_(view)
        else:
            view.copy_(p.data)
        offset += p.numel()


class _ZeroJoinHook(JoinHook):
    """A joined rank still takes part in each step's broadcasts: it steps its shard with the gradients it has
    (a ``Joinable`` registered before this one sets them, as torch's join test does) and gathers."""

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps ``optimizer_class`` and shards its state across the ranks of ``process_group`` (ZeRO stage 1).

    A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``: the same arguments, the same partition and
    local optimizer (``optim``), the same ``state_dict`` (after ``consolidate_state_dict(to)`` on every rank), and
    the parameters torch's class gives, bit for bit; the updated parameters travel in fewer broadcasts.

    Args:
        params: an iterable of tensors or of parameter-group dicts, all of the same dense type.
        optimizer_class: the local optimizer's class (``torch.optim.AdamW``...).
        process_group: the group to shard across (default: the default group).
        parameters_as_bucket_view: the parameters become views of one flat buffer a device, broadcast in place (no copy
            in or out); with ``False`` (the default) each parameter keeps its own storage.
        overlap_with_ddp: must be ``False``; ``True`` raises (torch's overlap runs on NCCL only, through its own
            DDP's comm hook).
        **defaults: the local optimizer's arguments (``lr``, ``betas``...).
    """

    def __init__(self, params: Any, optimizer_class: type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any):
        if overlap_with_ddp:
            raise ValueError("overlap_with_ddp=True is not supported by lockstep.ZeroRedundancyOptimizer (torch's "
                             "runs only on NCCL, through its own DDP's comm hook); pass overlap_with_ddp=False")
        params = _checked_params(params)
        self._initialized = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        group: Any = dist.group.WORLD if process_group is None else process_group
        self.process_group = group
        self.world_size: int = dist.get_world_size(group)
        self.rank: int = dist.get_rank(group)
        self.global_rank: int = dist.get_global_rank(group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optim_defaults = defaults
        self._partition = partition_parameters(self.param_groups, self.world_size)
        self._list_params()
        mine = self._partition[self.rank]
        local_groups = [dict(group, params=list(ps)) for group, ps in zip(self.param_groups, mine)]
        self.optim: Optimizer = optimizer_class(local_groups, **defaults)
        _sync_param_groups(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainable_mask()
        self._segments: list[_Segment] = []
        self._build_layouts()
        self._all_state_dicts: list[dict[str, Any]] = []
        self._initialized = True

    # ---- the partition and the segments
    def _list_params(self) -> None:
        # ``_all_params`` as torch's class names it: torch's own join test reads it from a join hook
        self._all_params: list[torch.Tensor] = list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _build_layouts(self) -> None:
        """One segment per device, in the order the devices first appear; only trainable parameters travel (a frozen
        one is never stepped). With bucket views, a parameter that leaves the storage gets storage of its own."""
        for old in self._segments if self.parameters_as_bucket_view else ():
            for p in (p for shard in old.shards for p in shard):
                if not p.requires_grad:
                    p.data = p.data.detach().clone()
        devices = list(dict.fromkeys(p.device for p in self._all_params))
        self._segments = []
        for device in devices:
            shards = [[p for group in rank_groups for p in group if p.device == device and p.requires_grad]
                      for rank_groups in self._partition]
            built = build_segment(shards, self.world_size, self.parameters_as_bucket_view)
            if built is not None:
                self._segments.append(built)

    def _gather_params(self) -> None:
        """Every rank's updated shard to every rank, by broadcasts from its owner, in the same order everywhere (the
        segments are computed alike on every rank); all in flight at once, as torch's, but the buffers of small
        parameters: those wait once COALESCE_BYTES are out, and are copied into the parameters after."""
        pending: list[Any] = []
        buffered: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []
        in_flight = 0
        for segment in self._segments:
            for rank in range(self.world_size):
                src = dist.get_global_rank(self.process_group, rank)
                if segment.storage is not None:  # bucket views: a rank's whole shard, in place
                    size = sum(p.numel() for p in segment.shards[rank])
                    if size:
                        part = segment.storage[rank * segment.numel:rank * segment.numel + size]
                        pending.append(dist.broadcast(part, src, group=self.process_group, async_op=True))
                    continue
                for run in segment.runs[rank]:
                    if _direct(run):  # from and into the parameter itself
                        pending.append(dist.broadcast(run[0].data, src, group=self.process_group, async_op=True))
                        continue
                    buffer = torch.empty(sum(p.numel() for p in run), dtype=run[0].dtype, device=run[0].device)
                    if rank == self.rank:
                        _pack(run, buffer, into_params=False)
                    work = dist.broadcast(buffer, src, group=self.process_group, async_op=True)
                    buffered.append((work, run if rank != self.rank else [], buffer))
                    in_flight += buffer.numel() * buffer.element_size()
                    if in_flight >= COALESCE_BYTES:  # bound the buffers' memory: land what is out
                        _land(buffered)
                        in_flight = 0
        _land(buffered)
        for work in pending:
            work.wait()

    # ---- the optimizer interface
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Steps this rank's shard (``closure`` and ``kwargs`` go to the local optimizer), then broadcasts the
        updated parameters. Every rank must call it."""
        Join.notify_join_context(self)
        trainable = self._trainable_mask()
        if trainable != self._trainable:  # a parameter was frozen or unfrozen: the segments carry trainable ones only
            self._trainable = trainable
            self._build_layouts()
        _sync_param_groups(self.param_groups, self.optim.param_groups)  # an LR scheduler writes the outer groups
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        _sync_param_groups(self.optim.param_groups, self.param_groups)
        self._gather_params()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group on every rank (call it on all of them): the earlier groups keep their shards (the greedy
        partition of a prefix does not change), this rank's part of the new one joins the local optimizer."""
        super().add_param_group(param_group)
        if not getattr(self, "_initialized", False):  # Optimizer.__init__ adding the constructor's groups
            return
        self._partition = partition_parameters(self.param_groups, self.world_size)
        self._list_params()
        self.optim.add_param_group(dict(self.param_groups[-1], params=list(self._partition[self.rank][-1])))
        _sync_param_groups(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainable_mask()
        self._build_layouts()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers every rank's local ``state_dict`` (on the CPU) on rank ``to`` of the group, whose ``state_dict()``
        then returns the whole optimizer's. Every rank must call it; one gather, where torch broadcasts per rank."""
        _sync_param_groups(self.param_groups, self.optim.param_groups)
        local = _to_cpu(self.optim.state_dict())
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, dst=dist.get_global_rank(self.process_group, to), group=self.process_group)
        self._all_state_dicts = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state as a plain ``optimizer_class`` would give it (global parameter indices), as of
        the last ``consolidate_state_dict`` to this rank."""
        if not self._all_state_dicts:
            raise RuntimeError("ZeroRedundancyOptimizer.state_dict(): the optimizer state has not been consolidated "
                               f"on this rank; call consolidate_state_dict(to={self.rank}) on every rank first")
        out = super().state_dict()
        state: dict[int, Any] = {}
        for rank, local in enumerate(self._all_state_dicts):
            state.update(self._global_state(local, rank))
        out["state"] = dict(sorted(state.items()))
        return out

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (on the CPU) in the whole optimizer's numbering, with the whole
        ``param_groups``: a checkpoint part (``lockstep.optim.state_parts``). No collective. Its own part is all
        this rank's ``load_state_dict`` needs at the same world size; every rank's, merged, load at any."""
        _sync_param_groups(self.param_groups, self.optim.param_groups)
        out = super().state_dict()
        out["state"] = dict(sorted(self._global_state(_to_cpu(self.optim.state_dict()), self.rank).items()))
        return out

    def _global_state(self, local: dict[str, Any], rank: int) -> dict[int, Any]:
        """Rank ``rank``'s local optimizer state, keyed by the whole optimizer's parameter indices."""
        index = {p: i for i, p in enumerate(self._all_params)}
        state: dict[int, Any] = {}
        for local_group, params in zip(local["param_groups"], self._partition[rank]):
            for local_index, p in zip(local_group["params"], params):
                if local_index in local["state"]:
                    state[index[p]] = local["state"][local_index]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a whole optimizer's state (this class's ``state_dict()`` or a plain optimizer's): the groups'
        settings here, this rank's shard of the state into the local optimizer. ``state_dict`` is not modified."""
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        index = {p: i for i, p in enumerate(self._all_params)}
        local_state: dict[int, Any] = {}
        local_groups = []
        next_id = 0  # the local optimizer numbers its parameters group after group, in shard order
        for saved, params in zip(state_dict["param_groups"], self._partition[self.rank]):
            ids = list(range(next_id, next_id + len(params)))
            next_id += len(params)
            for local_index, p in zip(ids, params):
                if index[p] in state_dict["state"]:
                    local_state[local_index] = state_dict["state"][index[p]]
            settings = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            local_groups.append({**settings, "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        _sync_param_groups(self.param_groups, self.optim.param_groups)

    # ---- Joinable
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._all_params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


def _checked_params(params: Any) -> list[Any]:
    """``params`` as a list of tensors or of group dicts, all of one dense type, or a one-line error saying why not."""
    wrong = f"ZeroRedundancyOptimizer: params must be an iterable of tensors or dicts, got {torch.typename(params)}"
    if isinstance(params, torch.Tensor):
        raise TypeError(wrong)
    try:
        items = list(params)
    except TypeError:
        raise TypeError(wrong) from None
    if not items:
        raise ValueError("ZeroRedundancyOptimizer: params is empty")
    if all(isinstance(x, dict) for x in items):
        if any("params" not in g for g in items):
            raise ValueError("ZeroRedundancyOptimizer: each parameter group in params needs a 'params' key")
        tensors = [p for g in items for p in ([g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])]
    elif all(isinstance(x, torch.Tensor) for x in items):
        tensors = items
    else:
        raise TypeError("ZeroRedundancyOptimizer: params must hold only tensors or only parameter-group dicts")
    kinds = {torch.typename(p) for p in tensors}
    if any(p.is_sparse for p in tensors) or len(kinds) > 1:
        raise ValueError(f"ZeroRedundancyOptimizer: every parameter must be of one dense type, got {sorted(kinds)}")
    return items


def _sync_param_groups(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Copies every setting but ``params`` (lr, betas, a scheduler's initial_lr...) group by group."""
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return copy.copy(value)


def _direct(run: list[torch.Tensor]) -> bool:
    """A run of one large contiguous parameter: broadcast from and into the parameter itself."""
    p = run[0]
    return len(run) == 1 and p.numel() * p.element_size() >= DIRECT_BYTES and p.data.is_contiguous()


def _land(buffered: list[tuple[Any, list[torch.Tensor], torch.Tensor]]) -> None:
    """Waits for the buffered broadcasts and copies each into its parameters (none on the rank that sent it)."""
    for work, run, buffer in buffered:
        work.wait()
        _pack(run, buffer, into_params=True)
    buffered.clear()
