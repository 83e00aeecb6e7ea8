"""Honour ``LOCKSTEP_AS_TORCH_DDP=1`` in every process that imports torch, whoever started it.

``accelerate launch``, Lightning's launcher and torchrun start the workers themselves, so no lockstep
code runs in them unless the script imports it. torch (2.5 and newer) calls the entry points of the
``torch.backends`` group at the end of ``import torch`` (its device-extension autoload, RFC
pytorch/pytorch#122468); lockstep registers ``maybe_use_as_torch_ddp`` there. Without the variable
it returns at once, importing nothing: the cost of ``import torch`` is one tiny module.
"""

from __future__ import annotations

import os

from lockstep.keys import AS_TORCH_DDP_ENV as ENV_VAR  # set by `lockstep launch --as-torch-ddp` too


def maybe_use_as_torch_ddp() -> None:
    if os.environ.get(ENV_VAR, "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    from lockstep.integrations.torch_ddp import use_as_torch_ddp

    use_as_torch_ddp()
