"""Shared bits of accelerate_run.py / lightning_run.py: the IMPL switch, data, model, result files."""

from __future__ import annotations

import os

import torch
from torch import nn

IMPL = os.environ.get("IMPL", "torch")
if IMPL not in ("torch", "lockstep"):
    raise SystemExit(f"IMPL must be torch or lockstep, got {IMPL!r}")


def maybe_use_lockstep() -> None:
    """IMPL=lockstep: route the libraries' DDP to lockstep (unless the env-var startup hook already did)."""
    if IMPL == "lockstep" and os.environ.get("LOCKSTEP_AS_TORCH_DDP", "0") in ("", "0"):
        import lockstep

        lockstep.use_as_torch_ddp()
    # with LOCKSTEP_AS_TORCH_DDP=1 nothing is called here: lockstep's torch.backends entry point does it at `import torch`


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
