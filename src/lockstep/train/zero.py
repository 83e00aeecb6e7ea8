"""The Trainer's ZeRO (``TrainerConfig.zero``): the sharded optimizer, and its checkpoint parts.

The Trainer is given an ordinary optimizer built on ``model.parameters()``; with ``zero=1`` it steps a
``lockstep.ZeroRedundancyOptimizer`` of the same class, groups and settings instead, with ``zero=2``
``DistributedDataParallel.zero_optimizer``'s. A checkpoint then holds no optimizer state itself: every rank writes its
shard as a part file beside it (``ckpt-000000120.optim-r1-of-4.pt``, the format of ``lockstep.optim.state_parts``,
checksummed like the checkpoint), all before rank 0 commits the checkpoint, which names them. A resume at the same
world size reads its own part only; at another world size, or into a plain optimizer, every part, merged
(``consolidated_optimizer_state`` gives that merge to a user: a plain torch optimizer's state dict).

Cost of a save: each rank writes 1/N of the optimizer state (no gather to rank 0, whose memory stays sharded).
The directory must be the same on every node (a shared file system), as for any checkpoint the Trainer resumes
from at another world size.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from lockstep.optim import ZeroRedundancyOptimizer, merge_parts
from lockstep.train.checkpoint_files import (
    FORMAT,
    CheckpointSaveError,
    checkpoint_path,
    load_checkpoint,
    save_atomic,
    verify,
)


def sharded_optimizer(ddp: Any, optimizer: torch.optim.Optimizer, stage: int) -> torch.optim.Optimizer:
    """The ZeRO optimizer of ``stage`` with ``optimizer``'s class, parameter groups and settings."""
    if optimizer.state:
        raise ValueError("TrainerConfig.zero: the optimizer given to the Trainer has state already (stepped or "
                         "loaded); give it a fresh one: the Trainer shards it (and resume=True restores its state)")
    groups = [dict(group) for group in optimizer.param_groups]
    # the constructor's own arguments only: ``defaults`` may hold more (AdamW's decoupled_weight_decay), which the
    # groups carry anyway
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if stage == 1:
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=ddp.process_group,
                                       **defaults)
    if len(groups) > 1:
        raise ValueError(f"TrainerConfig.zero=2: the optimizer has {len(groups)} parameter groups; "
                         "DistributedDataParallel.zero_optimizer takes one (use zero=1 for several)")
    return ddp.zero_optimizer(type(optimizer), stage=2, **defaults)


def part_path(checkpoint: Path, rank: int, world_size: int) -> Path:
    return checkpoint.with_name(f"{checkpoint.name.removesuffix('.pt')}.optim-r{rank}-of-{world_size}.pt")


def save_part(optimizer: Any, checkpoint: Path, rank: int, world_size: int, step: int, run_id: str | None) -> str:
    """Write this rank's part beside ``checkpoint`` (not yet written: rank 0 commits it after every part); the
    error's text, or "" when written."""
    try:
        part = {"format": FORMAT, "run_id": run_id, "step": step, "rank": rank, "world_size": world_size,
                "optimizer_part": optimizer.sharded_state_dict()}
        save_atomic(part, part_path(checkpoint, rank, world_size))
    except Exception as e:  # every rank's outcome goes to rank 0, which fails the checkpoint as a whole
        return f"rank {rank}: {type(e).__name__}: {e}"
    return ""


def parts_entry(step: int, stage: int, world_size: int) -> dict[str, Any]:
    """What the checkpoint says of its parts: the stage, the world size that wrote them, their file names."""
    return {"zero": stage, "world_size": world_size,
            "files": [part_path(checkpoint_path(".", step), r, world_size).name for r in range(world_size)]}


def check_parts(checkpoint: Path, errors: list[str]) -> None:
    """Rank 0, before committing ``checkpoint``: every rank wrote its part (``errors``: each rank's, "" if none)."""
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointSaveError(f"checkpoint {checkpoint}: its optimizer parts were not all written: "
                                  + "; ".join(failed))


def remove_parts(checkpoint: Path) -> None:
    """The part files of ``checkpoint`` (when it is pruned or could not be committed)."""
    for path in checkpoint.parent.glob(f"{checkpoint.name.removesuffix('.pt')}.optim-r*-of-*"):
        path.unlink(missing_ok=True)


def _read_part(path: Path) -> dict[str, Any]:
    problem = verify(path)
    if problem is not None:
        raise ValueError(f"optimizer part {path}: {problem}")
    return load_checkpoint(path)["optimizer_part"]


def optimizer_state(stage: int | None, checkpoint: Path, payload: dict[str, Any], rank: int,
                    world_size: int) -> tuple[dict[str, Any], bool]:
    """What an optimizer (of ZeRO ``stage``, or plain: None) loads from ``payload``: its whole state, or its own
    shard where the checkpoint's parts were written by the same stage at the same world size (the bool)."""
    parts = payload.get("optimizer_parts")
    if parts is None:  # a plain optimizer's checkpoint: a ZeRO optimizer keeps its shard of it
        return payload["optimizer"], False
    names = parts["files"]
    if stage and parts["zero"] == stage and parts["world_size"] == world_size:  # its own shard is all it needs
        return _read_part(checkpoint.with_name(names[rank])), True
    return merge_parts([_read_part(checkpoint.with_name(name)) for name in names]), False


def load_optimizer_state(optimizer: Any, state: dict[str, Any], own_shard: bool) -> None:
    """``optimizer`` takes ``state`` (``optimizer_state``'s): a shard through its sharded loader where it has one."""
    load = getattr(optimizer, "load_sharded_state_dict", optimizer.load_state_dict) if own_shard \
        else optimizer.load_state_dict
    load(state)


def consolidated_optimizer_state(checkpoint: str | Path) -> dict[str, Any]:
    """A ZeRO checkpoint's whole optimizer state as a plain torch optimizer of its class has it: for
    ``torch.optim.AdamW(model.parameters()).load_state_dict(...)`` outside lockstep. A plain checkpoint's own."""
    checkpoint = Path(checkpoint)
    payload = load_checkpoint(checkpoint)
    parts = payload.get("optimizer_parts")
    if parts is None:
        return payload["optimizer"]
    return merge_parts([_read_part(checkpoint.with_name(name)) for name in parts["files"]])
