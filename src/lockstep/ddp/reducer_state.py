"""The reducer's bookkeeping: bucket buffers, which parameters were used, and the missing-gradient error.

Kept apart from ``reducer.py`` so the hot path there reads top to bottom. The one
idea here: whether a parameter took part must be agreed across ranks, and the
agreement rides on a collective every rank issues anyway (the last bucket's spare
element), or on one small status all-reduce when a comm hook or unused-parameter
tracking needs more than one bit.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.collectives.clean import launch_clean
from lockstep.ddp.buckets import BucketPlan
from lockstep.ddp.graph import reachable_params


def is_dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory without gaps or overlaps in some order of its dimensions
    (contiguous, channels_last, a transpose), as torch's ``is_non_overlapping_and_dense``."""
    expected = 1
    for d in sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.size(d))):
        if tensor.size(d) == 1:
            continue
        if tensor.stride(d) != expected:
            return False
        expected *= tensor.size(d)
    return True


def slot_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s slot in ``flat``, from element ``offset``, laid out as ``like`` is, as torch's bucket views are.

    A channels_last or transposed parameter's gradient then keeps its strides where ``.grad`` is the slot
    (bucket views, lockstep's None), as autograd makes it under torch's default: elementwise kernels take
    the same path on it, so a half-precision optimizer step has torch's bits (a contiguous view of a
    channels_last fp16 weight moved SGD's update by one unit in the last place). A parameter that is not
    dense gets a plain contiguous view.
    """
    if is_dense(like):
        return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + offset)
    return flat[offset : offset + like.numel()].view(like.shape)


# sys.getrefcount of a slot only the bucket holds, read in ``Bucket.release``'s loop: the list's entry, the loop's
# name, the call's argument.
_SLOT_REFS = 3


@functools.lru_cache(maxsize=8)
def _placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A released bucket's ``buffer`` and ``flat``: no elements, the bucket's dtype and device (what readers between
    steps ask of them: the trace's element size, the auto-tuner's device). Shared; never written."""
    return torch.empty(0, dtype=dtype, device=device)


class Bucket:
    """Runtime state of one bucket: a flat buffer (+1 spare element, which the last bucket sends with the status
    flags), views, in-flight work."""

    __slots__ = ("index", "plan", "buffer", "flat", "views", "params", "grads", "seen", "work", "seq", "direct",
                 "compressed", "compressed_views", "sparse", "resident", "storage_freed")

    def __init__(self, index: int, plan: BucketPlan, params: Sequence[torch.nn.Parameter]):
        self.index = index
        self.plan = plan
        self.params = [params[i] for i in plan.param_indices]
        # dist.Work (default all-reduce) or a Future (comm hook). Kept after the backward that launched it,
        # until the next backward starts (``lifetime``).
        self.work: Any = None
        self.seq = 0  # the reducer's launch count when this bucket was last issued (diagnostics)
        # A direct bucket's gradient, all-reduced in place this backward (a detached alias of param.grad,
        # ``copy_in``), else None. Its work holds it until the next backward drops the work.
        self.direct: torch.Tensor | None = None
        # A direct bucket's buffer is used only when its gradient cannot be all-reduced where it is (``copy_in``):
        # left untouched (never paged in) until then; every use writes the whole slot first.
        self._allocate(zeroed=not plan.direct)
        self.reset()

    def _allocate(self, zeroed: bool) -> None:
        """The buffer (+1 spare element), ``flat`` (what a comm hook sees: the gradients only) and the slots."""
        plan = self.plan
        make = torch.zeros if zeroed else torch.empty
        self.buffer = make(max(plan.numel + 1, plan.padded_numel), dtype=plan.dtype, device=plan.device)
        self.flat = self.buffer[: plan.numel]
        # A sparse bucket (``plan.sparse``) has no slots: its one buffer element is the last bucket's spare.
        self.views = [] if plan.sparse else [slot_view(self.flat, o, p) for o, p in zip(plan.offsets, self.params)]
        self.compressed: torch.Tensor | None = None  # ``fused_compress``: the buffer's bytes as the wire dtype
        self.compressed_views: list[torch.Tensor] = []
        self.resident = True
        self.storage_freed = False

    def release(self) -> int:
        """Under bucket views, at a synchronised forward's start: let go of the buffer if no ``.grad`` is one of its
        slots and nothing else holds a slot; ``make_resident`` takes a fresh one at the next backward's first write.
        Returns the bytes let go of (freed unless something outside the reducer still holds the buffer).

        Why (issue #30): with bucket views the buckets are the gradients (G, one model's worth). After ``zero_grad()``
        (set_to_none, every torch optimizer's default) no ``.grad`` points into them, yet torch's reducer keeps them
        for the model's life, under the next forward's activations: on a transformer whose activations peak at the
        end of forward, bucket views then saved 0.8 G, not G, against copies. Released, the step peaks at the larger
        of parameters + activations and parameters + buckets + what activations are left at that bucket's first
        gradient. Cost: one allocation per bucket and one view per parameter per backward (~1 us each).

        The buffer is dropped, never resized under a live tensor: a tensor held elsewhere (a comm hook's state, a
        view kept by user code) keeps the old memory alive and valid, and simply does not follow the bucket. A slot
        the user still holds (a ``.grad`` kept across ``zero_grad()``) keeps its bucket, so it gets the next average
        as under torch's DDP.
        """
        if not self.resident or self.plan.sparse or self.work is not None:
            return 0
        for param in self.params:
            if param.grad is not None:
                return 0
        getrefcount = sys.getrefcount
        for view in self.views:
            if getrefcount(view) > _SLOT_REFS:  # a slot held outside the reducer: it must keep following the bucket
                return 0
        nbytes = self.buffer.numel() * self.buffer.element_size()
        self.buffer = self.flat = _placeholder(self.plan.dtype, self.plan.device)
        self.views = []
        self.compressed, self.compressed_views = None, []
        self.resident = False
        return nbytes

    def make_resident(self) -> None:
        """Before anything writes a released bucket: a fresh buffer (its contents unread: every slot is written
        before the bucket is sent, the spare element at its launch); a freed storage gets its memory back, with
        the padding past the gradients zeroed (``free_storage``)."""
        if not self.resident:
            if self.storage_freed:
                self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
                self.buffer[self.plan.numel:].zero_()
                self.storage_freed, self.resident = False, True
            else:
                self._allocate(zeroed=False)

    def free_storage(self) -> None:
        """ZeRO-2 (``zero2``), once the bucket's reduce-scatter is done: its memory goes, but the buffer and its
        views stay the same objects (the storage is resized in place, as FSDP frees its unsharded parameters), so
        whatever holds a view stays valid; ``make_resident`` gives the memory back before the next write."""
        if self.resident and not self.plan.sparse:
            self.buffer.untyped_storage().resize_(0)
            self.storage_freed, self.resident = True, False

    def reset(self) -> None:
        self.direct = None
        # A sparse bucket's gradient this backward (``copy_in``): the parameter's own ``.grad``, divided in
        # place (torch's reducer does the same), or this rank's stand-in where it has none; all-reduced in place.
        self.sparse: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.seen = [False] * len(self.params)


@dataclass
class Status:
    any_missing: bool
    globally_used: list[bool] | None  # None: every parameter counts as used (the common path)
    missing: list[int]  # this rank's missing parameters in the backward the flag is about
    late: bool = False  # the flag is about the previous backward (CUDA: see MissingFlag)


class MissingFlag:
    """The missing-gradient flag summed in the last bucket's spare element, read on the host.

    On CPU it is read at once (``.item()`` of a host tensor costs nothing). On CUDA ``.item()``
    would stall the host at every backward until the stream has run the whole backward and its
    all-reduces; instead the flag is copied into pinned memory (non_blocking) behind an event,
    and read at the end of the *next* backward, when that event is long past (its synchronize
    returns at once). Every rank holds the same summed flag and reads it at the same backward, so
    all raise together, one backward late, as torch's DDP does (its error comes at the next
    forward); a gradient missing in a run's very last backward goes unreported, as in torch.
    ``deferred=None`` defers on CUDA only; tests set True to run the deferred path on CPU.
    """

    def __init__(self) -> None:
        self.deferred: bool | None = None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._pending: tuple[torch.Tensor, list[int]] | None = None  # (host flag, missing) of the last backward

    def read(self, buffer: torch.Tensor, missing: list[int]) -> Status:
        """Status of this backward (CPU), or of the previous one (deferred), from the summed flag."""
        deferred = buffer.is_cuda if self.deferred is None else self.deferred
        if not deferred:
            return Status(bool(buffer[-1].real.item() > 0), None, missing)  # .real: a complex last bucket
        previous, self._pending = self._pending, None
        late = Status(False, None, [], late=True)
        if previous is not None:
            if self._event is not None:
                self._event.synchronize()  # recorded a backward ago: already complete, no stall
            late = Status(bool(previous[0].real.item() > 0), None, previous[1], late=True)
        if buffer.is_cuda:
            if self._host is None or self._host.dtype != buffer.dtype:
                self._host = torch.empty(1, dtype=buffer.dtype, pin_memory=True)
            self._host.copy_(buffer[-1:], non_blocking=True)  # after the all-reduces: wait() ordered the stream
            self._event = torch.cuda.Event()
            self._event.record()
            host = self._host
        else:
            host = buffer[-1:].clone()
        self._pending = (host, missing)
        return late


_warned_all_used = False


def _warn_all_used(num_params: int, nodes: int, walk_s: float) -> None:
    """Once per process (as torch's DDP, whose C++ reducer warns once): find_unused_parameters=True paid a
    graph walk, and this forward used every parameter. Says what the walk cost here, which torch's does not."""
    global _warned_all_used
    if _warned_all_used:
        return
    _warned_all_used = True
    warnings.warn(
        f"find_unused_parameters=True was given to DistributedDataParallel, but did not find any unused parameters "
        f"in this forward: all {num_params} were used. Finding them costs a walk of the autograd graph after every "
        f"synchronised forward ({nodes} nodes, {walk_s * 1e3:.2f} ms on this rank this time) and a status "
        "all-reduce after every backward. If no forward of this model ever leaves a parameter unused, pass "
        "find_unused_parameters=False; if a later forward may (control flow), this warning does not apply. "
        "(Warned once per process.)",
        UserWarning,
        stacklevel=2,
    )


class UsageTracker:
    """Which parameters took part: per backward, over a no_sync window, and (static graph) once for all."""

    def __init__(self, num_params: int, find_unused_parameters: bool, static_graph: bool):
        self.num_params = num_params
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.active = find_unused_parameters or static_graph  # the default path skips all of this
        self.track_window = find_unused_parameters  # record no_sync usage (PyTorch #69031)
        self.last_work: Any = None  # the status all-reduce of the last backward, kept (see exchange_status)
        self.used_in_window = [False] * num_params
        self.used = [False] * num_params
        # the last exchange's global map: what a joined rank sends in its shadow exchange, as torch's joined rank
        # all-reduces its reducer's device map, which holds the last exchange's sum (``_match_unused_params_allreduce``)
        self.last_globally_used: list[bool] | None = None
        self._static_first = static_graph
        self._counts = [0] * num_params
        self._expected: list[int] | None = None
        self._arrivals: list[int] = []
        self.static_unused: list[int] = []
        self._static_globally_used: list[bool] | None = None
        self._static_exchange_due = False
        self.flag = MissingFlag()
        self.graph_static = True  # torch's ddp_graph_static: no change yet in the unused set between iterations
        self._last_unused: list[int] | None = None

    def reset_backward(self) -> None:  # the reducer calls it where ``active`` only
        if self.active:
            self.used = [False] * self.num_params
            self._counts = [0] * self.num_params

    def in_static_first_iteration(self) -> bool:
        return self._static_first

    def unused_before_backward(self, outputs: Any, index_of: dict[int, int]) -> list[int]:
        """Parameters to mark ready right after forward: they will get no gradient in this backward. ``outputs``
        None: not known (torch's ``prepare_for_backward([])`` from a library), so none up front (with
        find_unused_parameters a parameter left without gradient is unused at the end of backward)."""
        if outputs is None:
            return []
        if self.find_unused:
            started = time.perf_counter()
            reached, nodes = reachable_params(outputs, index_of)
            unused = [i for i in range(self.num_params) if i not in reached]
            if not unused and not self.static_graph:
                _warn_all_used(self.num_params, nodes, time.perf_counter() - started)
            if self.graph_static and not self.static_graph and self._last_unused is not None:
                self.graph_static = unused == self._last_unused  # as torch's: once False, it stays False
            self._last_unused = unused
            return unused
        if self.static_graph and not self._static_first:
            return self.static_unused
        return []

    def gradient_complete(self, index: int, names: Sequence[str], defined: bool = True) -> bool:
        """Record a hook firing; True when the parameter's gradient is whole and can be reduced."""
        if defined:
            self.used[index] = True
        if not self.static_graph:
            return True
        self._counts[index] += 1
        if self._static_first:
            self._arrivals.append(index)
            return False
        expected = self._expected[index]  # type: ignore[index]
        if self._counts[index] > expected:
            raise RuntimeError(
                f"static_graph=True, but parameter {names[index]!r} received {self._counts[index]} gradient pieces in "
                f"this backward and {expected} in the first iteration: Your training graph has changed in this "
                "iteration, so the graph is not static. Use find_unused_parameters=True instead."
            )
        return self._counts[index] == expected

    def finish_static_first_iteration(self) -> list[int]:
        """Freeze the static graph: hook counts, unused parameters; return the ready order (by last piece)."""
        self._static_first = False
        self._expected = list(self._counts)
        self.static_unused = [i for i, n in enumerate(self._expected) if n == 0]
        last_seen: dict[int, int] = {}
        for position, i in enumerate(self._arrivals):
            last_seen[i] = position
        self._arrivals = []
        self._static_exchange_due = True
        return sorted(last_seen, key=last_seen.__getitem__)

    def launch_status(
        self, missing: list[int], comm_hook: bool, last_bucket: Bucket, group, joined: bool = False
    ) -> Any:
        """Launch the all-reduce ``exchange_status`` reads, if this backward needs one; None if the flag
        travelled in the last bucket. No side effect then, so ``exchange_status`` may call it again.

        The reducer calls it as soon as every other collective of the backward is issued (before waiting
        for the buckets), so the exchange queues behind them and its latency hides behind their waits.
        """
        need_bitmap = self.find_unused or self._static_exchange_due
        if not (need_bitmap or comm_hook):
            return None
        if not need_bitmap:
            # A comm hook's buckets carry no flag: one all-reduce of the flag alone, read as the last bucket's
            # would be. Filled on the device (no host-to-device copy, which would synchronise the stream).
            device = last_bucket.buffer.device if dist.get_backend(group) == "nccl" else "cpu"
            status = torch.full((1,), int(bool(missing)), dtype=torch.int32, device=device)
        else:
            if joined:
                used = self.last_globally_used or [False] * self.num_params
            else:
                used = [a or b for a, b in zip(self.used, self.used_in_window)]
            status = torch.tensor([int(bool(missing))] + [int(u) for u in used], dtype=torch.int32)
            if dist.get_backend(group) == "nccl":
                status = status.to(last_bucket.buffer.device)
        # Async and kept until the next status launch replaces it (complete by then; ``ddp.lifetime``).
        self.last_work = launch_clean(dist.all_reduce, status, group=group, async_op=True)
        return status, need_bitmap

    def exchange_status(self, missing: list[int], comm_hook: bool, last_bucket: Bucket, group, joined: bool = False,
                        launched: Any = None) -> Status:
        """Agree across ranks on missing gradients and on which parameters any rank used.

        Costs nothing extra on the common path (the flag travelled in the last bucket; one host read,
        one backward late on CUDA: ``MissingFlag``); with a comm hook, one all-reduce of the flag, read
        the same way; with a usage bitmap, one all-reduce of ``1 + num_params`` int32 values, read at
        once (a host sync on CUDA: find_unused_parameters and static graph's first exchange).
        ``launched``: what an earlier ``launch_status`` of this backward returned.
        """
        if launched is None and (self.active or comm_hook):  # else nothing to launch: the flag is in the bucket
            launched = self.launch_status(missing, comm_hook, last_bucket, group, joined)
        if launched is None:
            status = self.flag.read(last_bucket.buffer, missing)
            status.globally_used = self._static_globally_used
            return status
        tensor, bitmap = launched
        self.last_work.wait()
        if not bitmap:
            status = self.flag.read(tensor, missing)
            status.globally_used = self._static_globally_used
            return status
        values = tensor.tolist()
        self.used_in_window = [False] * self.num_params
        globally_used = [v > 0 for v in values[1:]]
        self.last_globally_used = globally_used
        if self._static_exchange_due:
            self._static_exchange_due = False
            self._static_globally_used = globally_used
        return Status(values[0] > 0, globally_used, missing)

