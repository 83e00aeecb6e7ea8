"""The global gradient norm of ZeRO-2's sharded gradients, with the bits of torch's ``clip_grad_norm_``.

torch's ``clip_grad_norm_`` takes each parameter's norm over its whole gradient (``torch._foreach_norm``), then the
norm of the stack of those, in ``model.parameters()`` order grouped by device and dtype; then it multiplies every
gradient by ``clamp(max_norm / (total + 1e-6), max=1)``. A sum of |g|^p over each rank's shards, all-reduced, is the
same number added in another order: its last bits differ (1.0915969610 against torch's 1.0915968418 on nanoGPT's
recipe), and a clip coefficient one unit in the last place off moves every later step (issue #43).

So each parameter's norm here is torch's, over its whole averaged gradient, wherever that gradient is whole:

* a parameter whole in one rank's shard (most of them): that rank norms it at the clip, from its shard;
* a parameter the shard boundaries split (at most world size - 1 a bucket, or a large one spanning several shards,
  which on GPT-2's layout is 54% of the model at 2 ranks and 99% at 8): its whole average exists only in backward,
  where the bucket is reduced by an all-reduce whose slice is kept (gloo's default, ``zero2_wire.choose_collectives``;
  with clipping in use the flat path reduces such buckets so too). Every rank norms it there, before the bucket's
  memory goes (``split_norms``), and keeps the norms while its shard's gradient stays as backward left it;
* otherwise (the first clip, before backward knew to norm them; gradients changed after backward, as a GradScaler's
  ``unscale_``; another norm type): its pieces are brought together at the clip, one all-reduce a bucket, each
  rank's piece and -0.0 elsewhere (x + -0.0 is x, bit for bit, -0.0 and NaN included).

The whole parameters' norms travel in one all-reduce of a value a parameter a dtype (each in its owner's slot, -0.0
elsewhere): one collective at the clip, as before, where it was one value. Which way the split parameters' norms
come is each rank's own choice, from state every rank shares in a data-parallel loop (the same clips, the same
in-place changes to the same gradients); a flag agreed on in the all-reduce would cost a host sync on a device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from lockstep.ddp.reducer_state import Bucket, slot_view

# torch's CUDA foreach kernels take their vectorised path only on 16-byte aligned tensors (multi_tensor_apply's
# is_aligned), which adds in another order; torch's .grad is an allocation of its own, so aligned.
ALIGN_BYTES = 16

Request = tuple[float, "bool | None"]  # (norm_type, foreach) of a clip


@dataclass(frozen=True)
class Split:
    """A parameter the shard boundaries split: where it starts in its bucket and in its bucket's exchange buffer."""

    index: int  # the reducer's
    offset: int  # in the bucket's flat layout
    packed: int  # in ``NormPlan.packed_numel[bucket]``'s buffer (16-byte aligned)


@dataclass(frozen=True)
class NormPlan:
    """Which rank norms which parameter (``plan_norms``), from the padded buckets' layout; every rank's is the same."""

    owners: dict[int, int]  # reducer index -> the rank whose shard holds the parameter whole, or -1: split (or empty)
    kinds: list[tuple[torch.device, torch.dtype, tuple[int, ...]]]  # per (device, dtype): its parameters, ascending
    split: list[list[Split]]  # per bucket
    packed_numel: list[int]  # per bucket: the length of its exchange buffer (its split parameters, aligned)

    @property
    def split_numel(self) -> int:
        """Elements of split parameters (what an exchange carries; what backward norms besides the reduce)."""
        return sum(self.packed_numel)


def plan_norms(buckets: Sequence[Bucket], world_size: int) -> NormPlan:
    owners: dict[int, int] = {}
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    split: list[list[Split]] = []
    packed_numel = []
    for bucket in buckets:
        plan = bucket.plan
        size = max(plan.padded_numel // world_size, 1)
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=plan.dtype).element_size())
        entries, end = [], 0
        for i, offset, p in zip(plan.param_indices, plan.offsets, bucket.params):
            first, last = offset // size, (offset + p.numel() - 1) // size
            owners[i] = first if p.numel() and first == last else -1  # an empty one: normed by every rank
            kinds.setdefault((plan.device, plan.dtype), []).append(i)
            if owners[i] < 0:
                entries.append(Split(i, offset, end))
                end = -(-(end + p.numel()) // align) * align
        split.append(entries)
        packed_numel.append(end)
    return NormPlan(owners, [(d, t, tuple(sorted(ix))) for (d, t), ix in kinds.items()], split, packed_numel)


@dataclass
class SplitNorms:
    """One bucket's split parameters' norms, taken in backward from its whole average (``ZeroShards``); good while
    its shard's gradient is the same tensor at the same version and the clip asks the same ``request``."""

    request: Request
    grad: torch.Tensor
    version: int
    norms: dict[int, torch.Tensor] = field(default_factory=dict)

    def holds(self, request: Request, grad: torch.Tensor | None) -> bool:
        return self.request == request and grad is self.grad and grad._version == self.version


def split_norms(average: torch.Tensor, entries: Sequence[Split], params: Mapping[int, torch.Tensor],
                request: Request, dtype: torch.dtype, packed: bool = False) -> dict[int, torch.Tensor]:
    """The norms of a bucket's split parameters, from ``average``: the bucket's whole averaged flat buffer (in the
    wire's dtype under a compress hook: each parameter's part cast to ``dtype`` first, as the shard's copy does), or
    with ``packed``, an exchange buffer."""
    views = []
    for s in entries:
        start, numel = (s.packed if packed else s.offset), params[s.index].numel()
        part = average[start:start + numel]
        if part.dtype != dtype:
            part = part.to(dtype)
        views.append(as_torchs_grad(slot_view(part, 0, params[s.index])))
    return dict(zip((s.index for s in entries), param_norms(views, *request)))


def exchange_split(shard_grad: torch.Tensor, shard_start: int, entries: Sequence[Split], packed_numel: int,
                   params: Mapping[int, torch.Tensor], group: dist.ProcessGroup,
                   request: Request) -> dict[int, torch.Tensor]:
    """A bucket's split parameters' norms at the clip: each rank's pieces (its shard begins at ``shard_start`` of
    the bucket) all-reduced into one buffer, -0.0 elsewhere, then normed by every rank alike. Every rank calls it
    for the same buckets in the same order."""
    buffer = torch.full((packed_numel,), -0.0, dtype=shard_grad.dtype, device=shard_grad.device)
    for s in entries:
        lo = max(s.offset, shard_start)
        hi = min(s.offset + params[s.index].numel(), shard_start + shard_grad.numel())
        if lo < hi:
            piece = shard_grad[lo - shard_start:hi - shard_start]
            buffer[s.packed + lo - s.offset:s.packed + hi - s.offset].copy_(piece)
    dist.all_reduce(buffer, group=group)
    return split_norms(buffer, entries, params, request, shard_grad.dtype, packed=True)


def exchange_whole(plan: NormPlan, mine: Mapping[int, torch.Tensor],
                   group: dist.ProcessGroup) -> dict[int, torch.Tensor]:
    """The norms of the parameters held whole (``mine``: this rank's, by reducer index) to every rank: one
    all-reduce of a value a parameter a (device, dtype), built by one stack (no index tensor copied to a device:
    no host sync, as torch's clip has none). A parameter without a gradient is in no rank's ``mine``: its entry is
    -0.0, for the caller to leave out."""
    norms: dict[int, torch.Tensor] = {}
    for device, dtype, indices in plan.kinds:
        absent = torch.full((), -0.0, dtype=dtype, device=device)
        buffer = torch.stack([mine.get(i, absent) for i in indices])
        dist.all_reduce(buffer, group=group)  # x + -0.0 is x: each norm arrives as its owner took it
        norms.update((i, buffer[k]) for k, i in enumerate(indices) if plan.owners[i] >= 0)
    return norms


def as_torchs_grad(view: torch.Tensor) -> torch.Tensor:
    """A parameter's slot of a shard or a bucket, as torch's ``.grad`` would be for the norm. On CPU the slot itself:
    ``vector_norm`` and ``_foreach_norm`` sum the same bits at any alignment (checked: 300 sizes x 9 offsets). On a
    device, a slot that is not 16-byte aligned is copied first (``ALIGN_BYTES``)."""
    if view.device.type == "cpu" or view.data_ptr() % ALIGN_BYTES == 0:
        return view
    return view.clone(memory_format=torch.preserve_format)


def param_norms(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """One norm a tensor (all on one device, of one dtype), as torch's ``_get_total_norm`` takes them."""
    if not tensors:
        return []
    if _use_foreach(tensors, tensors[0].device, foreach):
        return list(torch._foreach_norm(tensors, norm_type))
    return [torch.linalg.vector_norm(g, norm_type) for g in tensors]


def total_norm(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of the per-parameter norms (given in ``model.parameters()`` order), stacked as torch's
    ``_get_total_norm`` stacks them: grouped by device and dtype with torch's own grouping, whose order is its map's."""
    if not norms:
        return torch.tensor(0.0)
    first_device = norms[0].device
    ordered = [n for _, group in _grouped(norms) for n in group]
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in ordered]), norm_type)


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None) -> None:
    """Every gradient times ``clamp(max_norm / (total + 1e-6), max=1)``, as torch's ``_clip_grads_with_norm_``."""
    if not grads:
        return
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for device, group in _grouped(grads):
        if _use_foreach(group, device, foreach):
            torch._foreach_mul_(group, coef.to(device))
        else:
            for g in group:
                g.mul_(coef.to(device))


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's choice in ``clip_grad_norm_`` (its error too): the foreach kernels where asked or supported."""
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def _grouped(tensors: list[torch.Tensor]) -> list[tuple[torch.device, list[torch.Tensor]]]:
    """torch's grouping by (device, dtype), in its order (its C++ map's, not first seen: clip_grad_norm_'s order)."""
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    return [(device, [t for t in group if t is not None]) for (device, _), ([group], _) in grouped.items()]
