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
    "DistributedDataParallel": "ddp",
    "NaiveDistributedDataParallel": "naive",
    "DistributedSampler": "sampler",
    "Trainer": "trainer",
    "TrainerConfig": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lockstep.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
