"""Pickling and deepcopy of the wrapper, as torch's DDP: the process group and the reducer stay behind.

A mixin of ``DistributedDataParallel``: loading (or ``copy.deepcopy``) rebuilds the reducer on the default
group, and the diagnostics that hold the group or the store (replica check, trace, profiler ranges) are set up
again, without a trace (its files belong to the original).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch.distributed as dist

from lockstep.ddp import diagnose
from lockstep.ddp.config import DiagnosticsOptions
from lockstep.ddp.torch_surface import TorchReducer


def _default_group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "DistributedDataParallel: no default process group to load onto: call init_process_group first"
        )
    return cast(dist.ProcessGroup, dist.group.WORLD)  # set once initialised


class _Loadable(diagnose.DiagnosedDDP, Protocol):
    """The wrapper, as loading it needs it (its diagnostics are set up again, ``diagnose``)."""

    process_group: dist.ProcessGroup
    reducer: TorchReducer

    def _build_reducer(self) -> TorchReducer: ...


class Pickling:
    """``__getstate__``/``__setstate__`` for the wrapper (which provides ``_build_reducer``)."""

    def __getstate__(self) -> dict:
        if self.process_group is not dist.group.WORLD and self.process_group is not _default_group():
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That is, "
                "when you have called init_process_group and have not passed process_group argument to DDP constructor"
            )
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        for name in ("_replica_check", "trace", "_profiler_ranges"):  # hold the group, the store: rebuilt on load
            state.pop(name, None)
        return state

    def __setstate__(self: _Loadable, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = _default_group()
        self.reducer = self._build_reducer()
        options = DiagnosticsOptions(state.get("check_replicas_every"), state.get("detect_nonfinite", False))
        diagnose.setup(self, options)  # no trace: its files belong to the original
