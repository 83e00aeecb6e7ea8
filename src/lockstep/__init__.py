"""lockstep: distributed data-parallel training for PyTorch.

A drop-in ``DistributedDataParallel`` and ``DistributedSampler`` with a reducer
written in Python, process-group setup from any launcher, and the tools around
them (launch, Trainer, collectives, cost model).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it. Imported on first use, so `import lockstep`
# stays cheap and a CLI subcommand loads only what it needs.
_EXPORTS = {
    "init": "process_group",
    "shutdown": "process_group",
    "is_main": "process_group",
    "get_logger": "process_group",
    "DistEnv": "process_group",
    "DistributedDataParallel": "ddp.wrapper",
    "NaiveDistributedDataParallel": "ddp.naive",
    "DiLoCo": "ddp.diloco",
    "DiLoCoConfig": "ddp.diloco",
    "OuterSyncError": "ddp.diloco",
    "DistributedSampler": "sampler",
    "Trainer": "train.trainer",
    "TrainerConfig": "train.config",
    "accumulation_steps": "train.resize",
    "resume": "train.resize",
    "InPlaceRecovery": "train.inplace",
    "PeerLost": "train.inplace",
    "PeersJoined": "train.inplace",
    "use_as_torch_ddp": "integrations.torch_ddp",
    "check_replicas": "diagnostics.checks",
    "ReplicaMismatchError": "diagnostics.checks",
    "NonfiniteGradientError": "diagnostics.nonfinite",
    "ZeroRedundancyOptimizer": "optim.zero",
}

__all__ = sorted(_EXPORTS)


# The parts, as subpackages (see docs/architecture.md, "Layout", for which may import which):
#   process_group, sampler, slurm   set-up from the environment; the sampler
#   collectives/   ring and tree all-reduce over send/recv
#   comm_hooks/    the hook contract, allreduce / fp16 / bf16 / chain stages, PowerSGD
#   optim/         ZeroRedundancyOptimizer (ZeRO-1)
#   ddp/           the DistributedDataParallel wrapper, its reducer, buckets, join, naive reference
#   diagnostics/   replica and non-finite checks, the overlap timeline (trace), hang reports
#   launch/        `lockstep launch` on torch's elastic agent, rank output, failure report
#   perf/          cost model, plan, all-reduce benchmark
#   train/         Trainer, checkpoint, metrics, data, demo
#   integrations/  use_as_torch_ddp() for Accelerate / Lightning / HF Trainer, a Lightning strategy
_SUBPACKAGES = ("collectives", "comm_hooks", "ddp", "diagnostics", "integrations", "launch", "optim", "perf", "train")


def __getattr__(name: str):
    if name in _SUBPACKAGES:  # `lockstep.comm_hooks.chain` works after a bare `import lockstep`
        return importlib.import_module(f"lockstep.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lockstep.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
