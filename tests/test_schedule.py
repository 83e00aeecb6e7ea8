"""A joined rank issues exactly the collectives a training rank issues, in every mode (``lockstep.ddp.reducer.finish_collectives``).

Under ``model.join()`` a rank that ran out of data stands in for each step the others still train
(``Reducer.shadow_backward``); if its collectives differ from a training rank's in kind, size, dtype or
order, the ranks pair them up wrongly and hang. Here rank 0 trains one step more than rank 1, and each rank
records every collective it issues from that step on (rank 0: its last step, then the join context's exit;
rank 1: the join context's exit, which shadows rank 0's step) by wrapping torch.distributed's functions and
the process group's methods in the ranks: the real collectives still run. The two sequences must be equal,
in every mode the end of backward has.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

_DIST_FUNCTIONS = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor",
                   "broadcast_object_list", "reduce_scatter_tensor", "barrier", "all_to_all", "reduce_scatter_single",
                   "all_gather_single")
_GROUP_METHODS = ("allreduce", "broadcast", "allgather", "_allgather_base", "allreduce_coalesced", "barrier",
                  "reduce_scatter", "alltoall", "_reduce_scatter_base", "reduce_scatter_single", "all_gather_single")


class Recorder:
    """Every collective this process issues while ``on``, as (op, numel, dtype); nested calls (``dist.all_reduce``
    reaching the group's ``allreduce``) count once, as the outermost. A ``RingQueue``'s ops (ZeRO-2's ring pair)
    count where they are launched, in the caller's thread, not where its thread sends them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self.on = False
        self._local = threading.local()
        self._lock = threading.Lock()
        for name in _DIST_FUNCTIONS:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name), 0))
        for name in _GROUP_METHODS:
            if hasattr(dist.ProcessGroup, name):
                setattr(dist.ProcessGroup, name, self._wrap("pg." + name, getattr(dist.ProcessGroup, name), 1))
        from lockstep.collectives.ring_queue import RingQueue

        for name in ("reduce_scatter", "all_gather"):
            setattr(RingQueue, name, self._wrap("ring_" + name, getattr(RingQueue, name), 1))

    def _wrap(self, name: str, fn: Any, tensor_arg: int) -> Any:
        recorder = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(recorder._local, "depth", 0)
            if recorder.on and depth == 0:
                with recorder._lock:
                    recorder.calls.append((_kind(name),) + _describe(args[tensor_arg] if len(args) > tensor_arg else None))
            recorder._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                recorder._local.depth = depth

        return wrapped


def _kind(name: str) -> str:
    """``dist.all_reduce`` and the group's ``allreduce`` are one kind of collective (the reducer calls the latter)."""
    if name in ("reduce_scatter_single", "pg.reduce_scatter_single", "pg._reduce_scatter_base"):
        return "reduce_scatter_tensor"  # torch >= 2.12's name of it, and the group's method under both
    if name in ("all_gather_single", "pg.all_gather_single", "pg._allgather_base"):
        return "all_gather_into_tensor"
    return {"pg.allreduce": "all_reduce", "pg.broadcast": "broadcast", "pg.allgather": "all_gather",
            "pg.barrier": "barrier"}.get(name, name)


def _describe(arg: Any) -> tuple[Any, Any]:
    if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
        arg = arg[0]
    if isinstance(arg, torch.Tensor):
        return arg.numel(), str(arg.dtype)
    return None, None  # an object collective: its pickled size may differ between ranks


class _Net(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=sparse)
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)  # a buffer broadcast in each forward
        self.fc2 = nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4)  # only with use_all

    def forward(self, x: torch.Tensor, use_all: bool) -> torch.Tensor:
        h = self.fc2(torch.relu(self.bn(self.fc1(self.embed(x).mean(1)))))
        return self.unused(h) if use_all else h


MODES: dict[str, dict] = {
    "default": {},
    "find_unused_parameters": {"find_unused_parameters": True, "use_all": False},
    "static_graph": {"static_graph": True},
    "bucket_view_false": {"gradient_as_bucket_view": False},
    "bucket_view_true": {"gradient_as_bucket_view": True},
    "bucket_view_none": {"gradient_as_bucket_view": None},
    "comm_hook": {"hook": "allreduce"},
    "comm_hook_fused_fp16": {"hook": "fp16"},
    "detect_nonfinite": {"detect_nonfinite": True},
    "sparse": {"sparse": True},
    "sparse_find_unused": {"sparse": True, "find_unused_parameters": True, "use_all": False},
    # ZeRO-2 (``zero2``): reduce-scatters, the flag's all-reduce, and the step's all-gathers (a joined rank steps
    # its shards in its shadow round)
    "zero2": {"zero": True},  # on gloo: the ring's halves, recorded at launch (``zero2_wire.choose_collectives``)
    "zero2_fp16": {"zero": True, "hook": "fp16"},
    "zero2_flat": {"zero": "flat"},  # reduce_scatter_tensor and all_gather_into_tensor
    "zero2_all_reduce": {"zero": "all_reduce"},  # gloo's all-reduce pair (slice kept, -0.0 elsewhere)
}


def _sequences(rank: int, recorder: Recorder, mode: dict, steps_both: int) -> list[tuple]:
    import lockstep
    from lockstep.comm_hooks import allreduce_hook, fp16_compress_hook

    mode = dict(mode)
    hook, use_all, sparse = mode.pop("hook", None), mode.pop("use_all", True), mode.pop("sparse", False)
    zero = mode.pop("zero", False)
    if zero in ("flat", "all_reduce"):
        os.environ["LOCKSTEP_ZERO_COLLECTIVES"] = zero
    torch.manual_seed(0)
    model = lockstep.DistributedDataParallel(_Net(sparse), bucket_cap_mb=0.001, **mode)  # several buckets
    if hook is not None:
        model.register_comm_hook(None, {"allreduce": allreduce_hook, "fp16": fp16_compress_hook}[hook])
    opt = model.zero_optimizer(torch.optim.SGD, lr=0.1) if zero else torch.optim.SGD(model.parameters(), lr=0.1)
    os.environ.pop("LOCKSTEP_ZERO_COLLECTIVES", None)  # read at binding
    generator = torch.Generator().manual_seed(rank)
    recorder.calls, recorder.on = [], False
    with model.join():
        for step in range(steps_both + (1 if rank == 0 else 0)):
            if step == steps_both:
                recorder.on = True  # rank 0's extra step: rank 1 shadows it
            opt.zero_grad()
            model(torch.randint(0, 50, (6, 3), generator=generator), use_all).pow(2).mean().backward()
            opt.step()
        recorder.on = True  # rank 1: from here the join context shadows rank 0's step, then both finish
    recorder.on = False
    return recorder.calls


def _all_modes(rank: int, world_size: int) -> dict:
    recorder = Recorder()
    out = {}
    for name, mode in MODES.items():
        out[name] = _sequences(rank, recorder, mode, steps_both=2)
    # A rank that joins before its own first backward: the rebuild of the buckets is in the shadowed round.
    out["join_at_once"] = _sequences(rank, recorder, {}, steps_both=0)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_modes, world_size=2, timeout_s=300)


@pytest.mark.parametrize("mode", [*MODES, "join_at_once"])
def test_joined_rank_issues_the_training_ranks_collectives(results, mode):
    training, joined = results[0][mode], results[1][mode]
    reduces = [c for c in training if c[0] in ("all_reduce", "reduce_scatter_tensor", "ring_reduce_scatter")]
    assert len(reduces) >= 6, training  # the join round, the buckets, the status: the sequence is not empty
    if mode in ("zero2_flat", "zero2", "zero2_fp16"):  # the step's all-gathers, one a bucket, after the reduces
        gather, scatter = ("all_gather_into_tensor", "reduce_scatter_tensor") if mode == "zero2_flat" else (
            "ring_all_gather", "ring_reduce_scatter")
        assert sum(c[0] == gather for c in training) == sum(c[0] == scatter for c in training) >= 2, training
    assert training == joined, "\n".join(
        f"{i}: training {t}   joined {j}{'   <--' if t != j else ''}"
        for i, (t, j) in enumerate(zip(training + [None] * len(joined), joined + [None] * len(training)))
        if t is not None or j is not None
    )
