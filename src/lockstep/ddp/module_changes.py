"""Parameters changed after the wrapper was built: named in the error, warned about where silent.

DDP (torch's and lockstep's) takes the module's trainable parameters once, at construction. A layer
replaced afterwards (``model.module.head = nn.Linear(...)``, a new head for fine-tuning) or a parameter
frozen afterwards (``requires_grad_(False)``) then breaks the step in one of two ways:

* without ``find_unused_parameters``, the old parameters get no gradient: torch raises "Expected to have
  finished reduction ..." at the next forward, which names indices, not the cause. lockstep's
  missing-gradient error (``errors.raise_missing_gradients``) adds, per rank, what became of each
  missing parameter: replaced, removed, or frozen since the wrapper was built, and the remedy.
* with ``find_unused_parameters`` or ``static_graph``, the old parameters count as unused and the new
  ones are trained on each rank's own gradient, never averaged: the replicas drift apart silently (in
  torch's DDP as well). lockstep warns, at the next forward, naming the parameters it does not average.
  Not in torch's DDP. How it knows, cheaply: torch's global module and parameter registration hooks
  bump a counter whenever any module gets a submodule or a parameter assigned (anywhere in the process);
  a forward compares one integer and walks the module's parameters only when the counter moved. A
  parameter frozen later needs no warning: find_unused_parameters treats it as unused, as torch does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

REMEDY_REPLACED = "build DistributedDataParallel after changing the model (or wrap the changed model again)"
REMEDY_FROZEN = "pass find_unused_parameters=True, or wrap the model again after freezing"


# Bumped by the registration hooks: a module or parameter was assigned to some module in this process.
GENERATION = [0]
_hooks_installed = False


def _bump(module: nn.Module, name: str, value: object) -> None:
    GENERATION[0] += 1  # returns None: torch keeps the value as given


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:  # once per process; they stay (a counter bump per registration, nothing else)
        register_module_module_registration_hook(_bump)
        register_module_parameter_registration_hook(_bump)
        _hooks_installed = True


class ModuleChanges:
    """Compares the module's parameters now with those the reducer was built with (names as ``named_parameters``)."""

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor], names: Sequence[str], ignored: Iterable[str]):
        self.module = module
        self.params = list(params)
        self.names = list(names)
        self.ignored = set(ignored)
        self.warned: set[str] = set()
        _install_hooks()
        self.seen = GENERATION[0]  # the wrapper's forward calls ``warn_not_averaged`` when GENERATION moves on

    def explain(self, missing: Sequence[int]) -> str:
        """What became of the parameters at ``missing`` (reducer indices) since construction; "" if nothing."""
        current = dict(self.module.named_parameters(remove_duplicate=False))
        replaced, frozen = [], []
        for i in missing:
            now = current.get(self.names[i])
            if now is not self.params[i]:
                replaced.append(f"{self.names[i]!r} ({'removed' if now is None else 'replaced'})")
            elif not now.requires_grad:
                frozen.append(repr(self.names[i]))
        parts = []
        if replaced:
            parts.append(f"changed in the module after DistributedDataParallel was built: {', '.join(replaced)}: "
                         f"{REMEDY_REPLACED}")
        if frozen:
            parts.append(f"set to requires_grad=False after DistributedDataParallel was built: {', '.join(frozen)}: "
                         f"{REMEDY_FROZEN}")
        return "; ".join(parts)

    def not_averaged(self) -> list[str]:
        """Trainable parameters of the module now that the reducer does not know (their gradients stay local)."""
        known = {id(p) for p in self.params}
        return [n for n, p in self.module.named_parameters()
                if p.requires_grad and id(p) not in known and n not in self.ignored]

    def warn_not_averaged(self) -> None:
        """Warn where trainable parameters were added or replaced after construction (once per parameter name)."""
        self.seen = GENERATION[0]
        names = [n for n in self.not_averaged() if n not in self.warned]
        if names:
            self.warned.update(names)
            shown = ", ".join(map(repr, names[:20])) + (" ..." if len(names) > 20 else "")
            warnings.warn(
                f"DistributedDataParallel: the module has trainable parameters it was not built with ({shown}): "
                "they were added or replaced after construction, so their gradients are not averaged across ranks "
                f"and the replicas will drift apart; {REMEDY_REPLACED}.",
                UserWarning,
                stacklevel=6,  # the line that called the model (through Module.__call__ and forward)
            )
