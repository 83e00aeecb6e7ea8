"""Shared bits of the library scripts: the IMPL switch, data, model, result files.

``IMPL=lockstep,torch`` trains twice in the same launched processes: lockstep's DDP first (fresh processes, as a user
runs it), then torch's as the reference, after ``use_as_torch_ddp(False)`` gave the libraries torch's class back. One
launch instead of two: a launch costs ~1.5 CPU-s a process (~5 with Lightning), a second training a fraction of that.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

RUNS = tuple(os.environ.get("IMPL", "torch").split(","))
if not RUNS or any(impl not in ("torch", "lockstep") for impl in RUNS) or len(set(RUNS)) != len(RUNS):
    raise SystemExit(f"IMPL must be torch, lockstep or both comma-separated, got {os.environ.get('IMPL')!r}")
IMPL = RUNS[0]  # the run under way: switch_to() moves it on, check_ddp_class() reads it
OUT = os.environ.get("OUT") or f"/tmp/{os.path.splitext(os.path.basename(sys.argv[0]))[0]}"


def maybe_use_lockstep() -> None:
    """IMPL=lockstep: route the libraries' DDP to lockstep (unless the env-var startup hook already did)."""
    if IMPL == "lockstep" and os.environ.get("LOCKSTEP_AS_TORCH_DDP", "0") in ("", "0"):
        import lockstep

        lockstep.use_as_torch_ddp()
    # with LOCKSTEP_AS_TORCH_DDP=1 nothing is called here: lockstep's torch.backends entry point does it at `import torch`


def switch_to(impl: str) -> None:
    """The next run trains with ``impl``'s DDP; torch's takes back every name lockstep's took (the hook's too)."""
    global IMPL
    IMPL = impl
    if impl == "lockstep":
        maybe_use_lockstep()
    elif "lockstep.integrations.torch_ddp" in sys.modules:
        from lockstep.integrations.torch_ddp import use_as_torch_ddp

        # Also gives torch's class back to library modules imported after the patch (Lightning's strategies).
        use_as_torch_ddp(False)
    is_torch = torch.nn.parallel.DistributedDataParallel.__module__ == "torch.nn.parallel.distributed"
    assert is_torch == (impl == "torch"), torch.nn.parallel.DistributedDataParallel


def out_path(impl: str, suffix: str = ".pt") -> str:
    """Where ``impl``'s run writes its result: ``$OUT/<impl><suffix>``; its checkpoints go under ``$OUT/<impl>/``."""
    os.makedirs(OUT, exist_ok=True)
    return os.path.join(OUT, impl + suffix)


def digits(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from lockstep.train.data import digits_arrays  # scikit-learn's digits without its ~1 CPU-s import

    pixels, labels = digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    if n is not None:
        x, y = x[:n], y[:n]
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: a buffer that DDP broadcasts from rank 0 each synchronised forward.
    return nn.Sequential(nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Linear(48, 10))


def check_ddp_class(model: nn.Module) -> str:
    """Which class actually wraps the model; asserts it matches IMPL and passes torch's isinstance."""
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), name
    want = "lockstep.ddp" if IMPL == "lockstep" else "torch.nn.parallel.distributed"
    assert type(model).__module__.startswith(want), (name, want)
    return name


def save_result(path: str, state: dict) -> None:
    torch.save({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}, path)
