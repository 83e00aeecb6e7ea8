"""Replica checks: are the model's parameters still the same on every rank?

DDP keeps replicas identical only if every rank applies the same averaged gradient with the same
optimizer step. A rank that edits a weight, skips a step or loads other state drifts silently; the
loss looks fine and the ranks train different models. The check is one small collective: each rank
fingerprints every parameter (a wrapping integer checksum of its bits and its float sum: two passes at
memory speed, on its device) and all ranks gather the ``num_params x 2`` table; equal replicas give
equal fingerprints, and any changed element changes the checksum. Only on a mismatch a second round (a
broadcast of the first differing parameter from rank 0 and a gather of one number per rank) finds the
largest difference, so every rank raises the same error, naming the parameter, the ranks that disagree and by how much.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn


class ReplicaMismatchError(RuntimeError):
    """Raised on every rank when the ranks' parameters differ."""


def _named_parameters(model: nn.Module, ignored: Sequence[str] = ()) -> list[tuple[str, torch.Tensor]]:
    inner = getattr(model, "module", None)  # a DDP wrapper: the user's names, without "module."
    module = inner if isinstance(inner, nn.Module) and hasattr(model, "reducer") else model
    return [(n, p) for n, p in module.named_parameters() if n not in ignored]  # ignored: DDP leaves them per rank


_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def fingerprints(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(params), 2]`` int64: each parameter's checksum of bits and its float sum (as float64 bits).

    The checksum sums the parameter's bit patterns as integers of its own width, wrapping: any single
    changed element changes it (a float sum can round a one-ulp change away), and it runs at memory speed
    (a float64 or int64 accumulation is ~40x slower here). Both are exact functions of the bits, so equal
    replicas give equal fingerprints.
    """
    rows = []
    with torch.no_grad():
        for p in params:
            d = p.detach() if p.is_contiguous() else p.detach().contiguous()
            as_int = _SAME_SIZE_INT[d.element_size()]
            bits = d.view(as_int).sum(dtype=as_int).to(torch.int64)
            value = (d.sum() if d.is_floating_point() else d.sum(dtype=torch.float64)).to(torch.float64)
            rows.append(torch.stack([bits, value.view(torch.int64)]))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.int64)
    table = torch.stack(rows)
    return table.cpu() if table.device.type != "cpu" else table


def check_replicas(model: nn.Module, group: dist.ProcessGroup | None = None, *, where: str = "",
                   ignored: Sequence[str] = (), hint: str = "") -> None:
    """Raise ``ReplicaMismatchError`` on every rank of ``group`` if the ranks' parameters differ.

    Every rank of the group must call it at the same point (it issues collectives on the group).

    Args:
        model: a module or a DistributedDataParallel wrapper (its ``.module`` is checked).
        group: the process group (default: the wrapper's, else the default group).
        where: added to the error (e.g. "before step 12").
        ignored: parameter names not to check (a wrapper's ``parameters_to_ignore``: DDP never syncs them).
        hint: appended to the error (what likely changed the parameters at this point).

    Costs two passes over the parameters and one all-gather of ``16 * num_params`` bytes per rank;
    on CUDA one host copy of the fingerprints (a sync), so every N steps rather than every step.
    """
    group = group if group is not None else getattr(model, "process_group", None)
    named = _named_parameters(model, ignored)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    mine = fingerprints([p for _, p in named])
    device = named[0][1].device if named and dist.get_backend(group) == "nccl" else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, mine.to(device), group=group)
    table = torch.stack([g.cpu() for g in gathered])  # [world, params, 2], bit patterns: a NaN equals itself
    differs = (table != table[0]).any(dim=2)  # [world, params]: differs from rank 0
    if not bool(differs.any()):
        return
    bad_params = differs.any(dim=0).nonzero().flatten().tolist()
    first = bad_params[0]
    name, param = named[first]
    ranks = differs[:, first].nonzero().flatten().tolist()
    largest = _largest_difference(param, group, world_size, device)
    worst = max(range(world_size), key=lambda r: largest[r])
    others = ""
    if len(bad_params) > 1:
        others = f"; {len(bad_params) - 1} more parameter(s) differ: " + ", ".join(
            repr(named[i][0]) for i in bad_params[1:6]) + (" ..." if len(bad_params) > 6 else "")
    raise ReplicaMismatchError(
        f"replicas differ{' ' + where if where else ''}: parameter {name!r} on rank(s) {ranks} differs from rank 0 "
        f"(largest absolute difference {largest[worst]:.6g}, on rank {worst}){others}. The ranks no longer train "
        "the same model: something changed parameters on some ranks only (an in-place edit, an optimizer step "
        "skipped or taken twice, state loaded on one rank). Replicas stay equal only when every rank applies the "
        "same averaged gradients with the same optimizer." + (" " + hint if hint else "")
    )


def _largest_difference(param: torch.Tensor, group, world_size: int, device: torch.device) -> list[float]:
    """max |param_r - param_0| for every rank r: a broadcast of the parameter and a gather of one number each."""
    reference = param.detach().to(device).clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, 0), group=group)
    with torch.no_grad():
        diff = (param.detach().to(device).double() - reference.double()).abs()
        if diff.numel():
            mine = diff.nan_to_num(nan=float("inf")).max().reshape(1)
        else:
            mine = torch.zeros(1, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    return [float(t.item()) for t in out]


FIRST_FORWARD_HINT = (
    "DistributedDataParallel broadcast rank 0's parameters when it was built, so they were changed on some ranks "
    "after that: a checkpoint loaded, or weights initialised, on some ranks only after wrapping? Load or initialise "
    "on every rank, or before wrapping. (lockstep checks this once, at the first synchronised forward, where torch's "
    "DDP would train the ranks apart silently; init_sync=False skips the check.)"
)


class PeriodicReplicaCheck:
    """``DDP(check_replicas_every=N)``: run ``check_replicas`` at the start of every N-th synchronised forward.

    And, by default (``first``: the wrapper was built with init_sync at a world size > 1), once at the first
    synchronised forward: the parameters were made equal at construction, so a difference there means they
    were changed on some ranks between construction and training (``FIRST_FORWARD_HINT``). Not in torch's
    DDP; costs the check once (two passes over the parameters, one all-gather of 16 bytes per parameter).

    The wrapper calls ``maybe_check(num_syncs)`` at the start of each synchronised forward, after the
    reducer's own start-of-forward collectives and before the buffer broadcast, so every rank issues the
    check's collective at the same place in its sequence. ``num_syncs`` (backwards synchronised so far) is
    the same on every rank, so every rank decides alike. Not inside ``model.join()``: a rank that has
    joined runs no forward and would leave the others waiting in the check.
    """

    def __init__(self, every: int | None, model: nn.Module, group: dist.ProcessGroup, first: bool = False,
                 ignored: Collection[str] = ()):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"DistributedDataParallel: check_replicas_every must be an int >= 1 or None, got {every!r}"
            )
        self.every = every
        self.model = model
        self.group = group
        self.first = first
        self.ignored = tuple(ignored)
        self._last_checked = 0
        self.next_due = self._next_due(0)
        """The first ``num_syncs`` at which ``due`` may be True: the wrapper asks ``due`` from one step before."""

    def _next_due(self, num_syncs: int) -> int | float:
        if self.first:
            return 0
        return math.inf if self.every is None else (num_syncs // self.every + 1) * self.every

    def due(self, num_syncs: int) -> bool:
        """Whether ``maybe_check(num_syncs)`` would check (it reads every parameter: an overlapped step must land)."""
        if self.first:
            return num_syncs == 0
        return not (self.every is None or num_syncs == 0 or num_syncs % self.every or num_syncs == self._last_checked)

    def maybe_check(self, num_syncs: int) -> None:
        if self.first:
            self.first = False
            self.next_due = self._next_due(num_syncs)
            if num_syncs == 0:
                check_replicas(self.model, self.group, where="at the first synchronised forward", ignored=self.ignored,
                               hint=FIRST_FORWARD_HINT)
                return
        if self.every is None or num_syncs == 0 or num_syncs % self.every or num_syncs == self._last_checked:
            return
        self._last_checked = num_syncs
        self.next_due = self._next_due(num_syncs)
        where = f"after {num_syncs} synchronised steps (checked at the next forward)"
        check_replicas(self.model, self.group, where=where, ignored=self.ignored)
