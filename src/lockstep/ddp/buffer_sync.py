"""Buffers before each forward: rank 0's, broadcast while the forward's first layers run.

torch's DDP broadcasts the buffers (BatchNorm's running statistics and step counters) before every
synchronised forward and waits for them there: a round trip between the ranks (~0.5 ms on gloo here,
more with skew) on the step's path before any compute. Here, where every synchronised buffer belongs to
a normalisation layer (``_NormBase``: BatchNorm, SyncBatchNorm, InstanceNorm with running stats), the
broadcast is launched at the start of the forward and waited for just before the first such layer runs
(a module forward pre-hook, registered for the length of the forward), so it overlaps whatever comes
first (the stem convolution of a CNN). Those layers read their buffers only in their own forward, so
every read still sees rank 0's values, bit for bit, as with torch.

The difference from torch's DDP, on purpose: code that reads such a buffer in the forward *before* its
layer has run (a parent module peeking at ``bn.running_mean`` first) sees this rank's own value of the
previous step. Any other owner of a synchronised buffer (the root module itself, a positional table, a
custom module), a forward under ``torch.compile``, a compiled submodule, several devices or a buffer
chunk too large for one collective: the broadcast is waited for before the forward, as in torch.

A module with no buffer to send (most transformers, MLPs) is not walked at every forward (0.35 ms for the
125 modules of ``benchmarks/ddp_step.py``'s transformer): it is remembered as such until torch's global
registration hooks see a buffer or a submodule assigned somewhere in the process. torch's DDP lists its
buffers once, at construction (``modules_buffers``); here a buffer registered later is still found, as before.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _NormBase

from lockstep.ddp.replicas import BROADCAST_CHUNK_BYTES, broadcast_coalesced, is_syncable, pack_bytes, unpack_bytes

# Bumped by torch's global hooks whenever any module gets a buffer or a submodule assigned (``register_buffer``,
# ``module.x = tensor`` for a buffer name, ``add_module``, ``module.layer = ...``): the modules remembered in
# ``NOTHING_TO_SEND`` are walked again after that. A buffer put in ``_buffers`` by hand, or a dtype changed by
# ``_apply`` (a complex buffer cast to float), goes unseen, as by torch's DDP, which never looks again.
GENERATION = [0]
_hooks: list[Any] = []
# module -> (generation, ignore) of its last walk, where it found nothing to send (weak: the user owns the module).
NOTHING_TO_SEND: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, Any]] = weakref.WeakKeyDictionary()


def _bump(module: torch.nn.Module, name: str, value: Any) -> None:
    GENERATION[0] += 1  # returns None: torch keeps the value as given


def _watch_registrations() -> None:
    if not _hooks:  # once per process; they stay (a counter bump per registration, nothing else)
        _hooks.append(torch.nn.modules.module.register_module_buffer_registration_hook(_bump))
        _hooks.append(torch.nn.modules.module.register_module_module_registration_hook(_bump))


class PendingBuffers:
    """A buffer broadcast in flight: waited for (and unpacked) before the first owning layer runs, or at ``finish``."""

    __slots__ = ("work", "flat", "tensors", "receive", "owners", "handle")

    def __init__(self, work: Any, flat: torch.Tensor, tensors: list[torch.Tensor], receive: bool, owners: set[int]):
        self.work, self.flat, self.tensors, self.receive, self.owners = work, flat, tensors, receive, owners
        # Global, not on the layers: nothing of lockstep's is left on the user's modules (pickling, state).
        self.handle: Any = torch.nn.modules.module.register_module_forward_pre_hook(self._before_module)

    def _before_module(self, module: torch.nn.Module, args: Any) -> None:
        if id(module) in self.owners:
            self.finish()

    def finish(self) -> None:
        """Wait for the broadcast and put rank 0's bytes into this rank's buffers; idempotent."""
        if self.handle is None:
            return
        self.handle.remove()
        self.handle = None
        self.work.wait()
        if self.receive:
            unpack_bytes(self.flat, self.tensors)


def sync_buffers(
    module: torch.nn.Module, ignore: Any, group: dist.ProcessGroup, src: Callable[[], int], defer: bool
) -> PendingBuffers | None:
    """Broadcast ``module``'s floating/integer buffers (those not in ``ignore``) from group rank ``src()``.

    ``src`` is called only where there are buffers to send: under join it is a collective of its own, which a
    joined rank issues only for a model with buffers.

    Returns the pending broadcast where it can overlap the forward (``defer`` and the module docstring's
    conditions), to be ``finish``-ed after the forward whatever happens; otherwise broadcasts and waits here
    and returns None. One module walk, as ``replicas.syncable_buffers``, skipped where the last one found
    nothing to send and no buffer or submodule was registered since (module docstring).
    """
    nothing = NOTHING_TO_SEND.get(module)
    if nothing is not None and nothing[0] == GENERATION[0] and nothing[1] is ignore:
        return None
    _watch_registrations()
    generation = GENERATION[0]  # before the walk: a registration during it makes the next forward walk again
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    owners: set[int] = set()
    defer = defer and not torch.compiler.is_compiling()
    # A compiled submodule is an OptimizedModule; where dynamo was never imported there is none (importing it
    # here would cost every process ~1 s at start-up).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = eval_frame.OptimizedModule if eval_frame is not None else ()
    for prefix, sub in module.named_modules():
        if isinstance(sub, compiled):
            defer = False
        for name, b in sub._buffers.items():
            if b is None or id(b) in seen or not is_syncable(b) or (f"{prefix}.{name}" if prefix else name) in ignore:
                continue
            seen.add(id(b))
            tensors.append(b)
            if sub is module or not isinstance(sub, _NormBase):
                defer = False
            else:
                owners.add(id(sub))
    if not tensors:
        NOTHING_TO_SEND[module] = (generation, ignore)
        return None
    src_rank = src()
    if defer and len({t.device for t in tensors}) == 1:
        tensors.sort(key=lambda t: -t.element_size())  # as broadcast_coalesced lays them out
        if sum(t.numel() * t.element_size() for t in tensors) < BROADCAST_CHUNK_BYTES:
            src_global = dist.get_global_rank(group, src_rank)
            flat = pack_bytes(tensors)
            work = dist.broadcast(flat, src=src_global, group=group, async_op=True)
            return PendingBuffers(work, flat, tensors, dist.get_rank() != src_global, owners)
    broadcast_coalesced(tensors, group, src_rank)
    return None
