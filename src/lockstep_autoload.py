"""``torch.backends`` entry point of the lockstep package: honour LOCKSTEP_AS_TORCH_DDP=1 at ``import torch``.

A top-level module of its own, outside the ``lockstep`` package, so that ``import torch`` can never fail
because of lockstep: another copy of lockstep earlier on sys.path, or a broken install, only turns the
patch off (with a warning when it was asked for). See ``lockstep.integrations.autoload``.
"""

import os


def maybe_use_as_torch_ddp() -> None:
    if os.environ.get("LOCKSTEP_AS_TORCH_DDP", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from lockstep.integrations.autoload import maybe_use_as_torch_ddp as apply
    except ImportError as e:  # a lockstep without integrations shadows this one
        import warnings

        warnings.warn(f"LOCKSTEP_AS_TORCH_DDP is set but lockstep's integrations cannot be imported: {e}", stacklevel=1)
        return
    apply()
