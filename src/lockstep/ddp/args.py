"""Checking and resolving DistributedDataParallel's constructor arguments, torch 2.13's newer ones included.

Every argument torch's DDP takes is accepted by name. Those with a meaning for our
reducer are resolved here to what it needs; those we do not support raise an error
naming the argument instead of being silently ignored.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist


def reject_unsupported(
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    skip_all_reduce_unused_params: bool,
) -> None:
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise ValueError(
            "DistributedDataParallel: delay_all_reduce_named_params / param_to_hook_all_reduce are not supported "
            "by lockstep (every parameter is reduced by its bucket during backward); leave them as None"
        )
    if mixed_precision is not None:
        raise ValueError(
            "DistributedDataParallel: mixed_precision is not supported by lockstep; use torch.autocast for compute "
            "and lockstep.comm_hooks.bf16_compress_hook / fp16_compress_hook to reduce in low precision"
        )
    if skip_all_reduce_unused_params:
        raise ValueError(
            "DistributedDataParallel: skip_all_reduce_unused_params=True is not supported by lockstep: skipping a "
            "bucket's all-reduce is only safe when every rank agrees it is unused, which lockstep does not assume"
        )


STATIC_WITH_FIND_UNUSED = (
    "find_unused_parameters=True was passed together with static graph: a static graph finds the unused parameters "
    "itself in its first iteration, so find_unused_parameters=True is not needed (it adds nothing); make sure the "
    "set of unused parameters does not change during training."
)


def warn_like_torch(check_reduction: bool, static_graph: bool, find_unused_parameters: bool) -> None:
    """The constructor warnings torch's DDP gives (FutureWarning for ``check_reduction``, a UserWarning for a
    static graph with find_unused_parameters), in lockstep's words, so ``-W error`` and warning filters see them."""
    if check_reduction:
        warnings.warn("DistributedDataParallel: `check_reduction` is deprecated (in torch as here) and ignored; "
                      "do not pass it.", FutureWarning, stacklevel=3)
    if static_graph and find_unused_parameters:
        warnings.warn(STATIC_WITH_FIND_UNUSED, UserWarning, stacklevel=3)


def reject_module(module: torch.nn.Module, device: torch.device, ignored: Container[str] = ()) -> None:
    """torch's DDP's checks of the module itself, with the offending parameter's or layer's name: no parameter
    left uninitialized (a lazy module before its first forward), and no SyncBatchNorm in a CPU module (refused at
    construction, not at the first forward where SyncBatchNorm itself would raise on the CPU input).

    Also no parameter or buffer on the ``meta`` device (a module built under ``torch.device("meta")`` for
    deferred initialisation and not materialised yet): torch's DDP fails there with "Tensor.item() cannot be
    called on meta tensors"; accepted, it would train replicas that were never made equal, with gradients that
    are never averaged. ``ignored``: the names DDP leaves alone (``_ddp_params_and_buffers_to_ignore``)."""
    for name, param in module.named_parameters():
        if isinstance(param, torch.nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. Run a dummy "
                f"forward pass to correctly initialize the modules "
                f"(parameter {name!r} is uninitialized: a lazy module)."
            )
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta and name not in ignored:
                raise RuntimeError(
                    f"DistributedDataParallel: {kind} {name!r} is on the meta device (it has no data yet): materialise "
                    "the module before wrapping it (module.to_empty(device=...) and initialise it, or load a "
                    "checkpoint into it), so that rank 0's values can be broadcast and the gradients averaged."
                )
    if device.type != "cpu":
        return
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.SyncBatchNorm):
            raise ValueError(
                f"SyncBatchNorm layers only work with GPU modules: "
                f"{name or type(module).__name__!r} is a SyncBatchNorm "
                "in a CPU module. On CPU use BatchNorm (DDP's forward_sync_buffers broadcasts rank 0's running stats) "
                "or move the model to the GPU before wrapping it."
            )


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup:
    """The group to average over: ``process_group``, a 1-D ``device_mesh``'s group, or the default group."""
    if device_mesh is not None:
        # RuntimeError and torch's sentences, as torch raises them (its tests match on them).
        if process_group is not None:
            raise RuntimeError(
                "Cannot specify both process_group and device_mesh arguments. "
                "(DistributedDataParallel: pass either process_group or device_mesh, not both)"
            )
        if getattr(device_mesh, "ndim", None) != 1:
            raise RuntimeError(
                f"Only 1D device mesh is supported, but got {device_mesh}. (DistributedDataParallel: device_mesh "
                f"has {getattr(device_mesh, 'ndim', '?')} dimensions)"
            )
        return device_mesh.get_group()
    if process_group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel: no process group: call lockstep.init() (or "
                "torch.distributed.init_process_group) first, or pass process_group="
            )
        return cast(dist.ProcessGroup, dist.group.WORLD)  # set once initialised (checked above)
    return process_group


def resolve_buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """``(forward_sync_buffers, init_sync_buffers)`` as torch 2.13 resolves them.

    ``forward_sync_buffers`` supersedes ``broadcast_buffers`` and wins when both are given;
    either old name warns (FutureWarning, torch's text). Buffers are synced at construction
    unless only the old ``broadcast_buffers=False`` was passed (rank-local buffers).
    """
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = ("Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is "
                       "deprecated and its value is ignored when `forward_sync_buffers` is provided.")
        else:
            message = ("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                       "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init.")
        warnings.warn(message, FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def sparse_flags(sparse: Sequence[bool] | None, num_params: int) -> list[bool]:
    """The reducer's ``sparse``: one flag per parameter (None: no gradient is sparse)."""
    flags = [bool(s) for s in sparse] if sparse is not None else [False] * num_params
    if len(flags) != num_params:
        raise ValueError(f"sparse: {len(flags)} flags for {num_params} parameters")
    return flags


def ignored_names(module) -> set[str]:
    """Parameter and buffer names to leave alone: torch's ``_ddp_params_and_buffers_to_ignore`` on the module."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def produces_sparse_gradient(module: torch.nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of ``module`` gets sparse gradients, as torch's DDP judges it
    (``expect_sparse_gradient``): it belongs to an ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``."""
    owner = module.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and bool(owner.sparse)
