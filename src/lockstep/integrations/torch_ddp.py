"""``use_as_torch_ddp()``: every library in the process builds lockstep's DDP where it would build torch's.

Libraries construct DDP in one of two ways, and the patch covers exactly those names:

- at call time, through the attribute ``torch.nn.parallel.DistributedDataParallel`` (Accelerate's
  ``prepare``, HF Trainer through Accelerate): the attributes of ``torch.nn.parallel`` and
  ``torch.nn.parallel.distributed`` are replaced, so a library imported *later* that does
  ``from torch.nn.parallel.distributed import DistributedDataParallel`` (Lightning's strategies)
  also takes lockstep's class;
- through a name held by an already-imported module (``from ... import DistributedDataParallel``
  at its top): each module of the known wrapping libraries (``KNOWN_LIBRARIES``) that holds torch's
  class under that name gets lockstep's. Other modules are left alone.

Undo with ``use_as_torch_ddp(False)``: every replaced name gets torch's class back, and so does the name in each
known library's module imported after the patch (it took lockstep's class from torch's module). lockstep's class
subclasses torch's, so the libraries' ``isinstance(m, DistributedDataParallel)`` checks hold either way.
"""

from __future__ import annotations

import sys
import threading

import torch.nn.parallel
import torch.nn.parallel.distributed

from lockstep.ddp.wrapper import DistributedDataParallel

TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel
KNOWN_LIBRARIES = ("accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "transformers")
_NAME = "DistributedDataParallel"
_patched: dict[str, object] = {}  # module name -> the class it held before
_lock = threading.Lock()


def use_as_torch_ddp(enable: bool = True) -> list[str]:
    """Make libraries build lockstep's DDP (``enable=False`` undoes it). Returns the modules patched now.

    Safe to call more than once; only modules holding torch's class itself are touched.
    """
    with _lock:
        if not enable:
            return _restore()
        changed = []
        for module_name in _targets():
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, _NAME, None) is TORCH_DDP:
                setattr(module, _NAME, DistributedDataParallel)
                _patched[module_name] = TORCH_DDP
                changed.append(module_name)
        return changed


def _targets() -> list[str]:
    """torch's two modules that hold the name, then every imported module of the known libraries."""
    known = [name for name in list(sys.modules) if name.split(".")[0] in KNOWN_LIBRARIES]
    return ["torch.nn.parallel", "torch.nn.parallel.distributed", *known]


def _restore() -> list[str]:
    """torch's class back under every name that holds lockstep's: the names replaced, and the name of each
    known library's module imported after the patch, which took lockstep's class from torch's module (Lightning's
    strategies: ``from torch.nn.parallel.distributed import DistributedDataParallel``). A user's own modules keep
    what they imported."""
    restored = []
    for module_name in _targets():
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, _NAME, None) is DistributedDataParallel:
            setattr(module, _NAME, _patched.get(module_name, TORCH_DDP))
            restored.append(module_name)
    _patched.clear()
    return sorted(restored)

