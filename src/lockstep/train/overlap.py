"""Whether the Trainer steps its optimizer in the next forward (``DistributedDataParallel.overlap_optimizer_step``).

On by default where it gives the plain step's bits: an optimizer whose update is element-wise per parameter (torch's
own classes below, not subclasses, which may add a global step), no gradient clipping by global norm (it needs every
gradient before any update), no fp16 GradScaler (its unscale reads every gradient first), and with the non-finite
check a world size that is a power of two (its verdict is then read before the launches). What it buys: on a link
slower than the backward, the next forward runs while the wire still carries the last layers' averages
(docs/performance.md, benchmarks/link.py).
"""

from __future__ import annotations

import torch

from lockstep.train.config import TrainerConfig

ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta")


def why_not_overlapped(cfg: TrainerConfig, optimizer: torch.optim.Optimizer, fp16_scaler: bool,
                       world_size: int) -> str | None:
    """Why the Trainer cannot overlap the optimizer step exactly, or None where it can."""
    name = type(optimizer).__name__
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or name not in ELEMENTWISE_OPTIMIZERS:
        return f"the optimizer {name} is not one of torch's element-wise ones ({', '.join(ELEMENTWISE_OPTIMIZERS)})"
    if cfg.grad_clip_norm is not None:
        return "grad_clip_norm needs every gradient before any update"
    if fp16_scaler:
        return "fp16's GradScaler unscales every gradient before any update"
    if cfg.detect_nonfinite and world_size & (world_size - 1):
        return f"detect_nonfinite at {world_size} ranks (not a power of two) reads its verdict after every bucket"
    return None


def wants_overlap(cfg: TrainerConfig, optimizer: torch.optim.Optimizer, fp16_scaler: bool, world_size: int) -> bool:
    """``cfg.overlap_step`` resolved: None -> where exact; True where it is not raises naming the reason."""
    if cfg.overlap_step is False:
        return False
    reason = why_not_overlapped(cfg, optimizer, fp16_scaler, world_size)
    if reason is not None and cfg.overlap_step:
        raise ValueError(f"TrainerConfig.overlap_step=True: {reason}")
    return reason is None
