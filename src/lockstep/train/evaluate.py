"""Exact evaluation: every sample of the eval set counted once across ranks, with one collective in all.

The plain module runs (no DDP forward, so no collective per batch: ranks may hold
one sample more or less, since the eval sampler does not pad), and one all-reduce
of [loss sum, correct, count, classified] at the end makes the totals global.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from lockstep.sampler import DistributedSampler


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_fn: Callable, data, make_loader: Callable, world_size: int, rank: int,
             batch_size: int, device: torch.device, autocast: Callable, group: dist.ProcessGroup | None) -> dict:
    """``eval_loss`` and ``eval_samples``, plus ``eval_accuracy`` when outputs are logits of class-index targets.

    ``make_loader(data, sampler, batch_size, epoch)`` builds the DataLoader; ``autocast()`` the autocast context.
    """
    sampler = DistributedSampler(data, world_size, rank, shuffle=False, pad=False)
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # NCCL reduces CUDA tensors only
    for inputs, targets in make_loader(data, sampler, batch_size, 0):
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast():
            outputs = model(inputs)
            loss = loss_fn(outputs, targets)
        sums[0] += loss.double().item() * len(targets)
        sums[2] += len(targets)
        if outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            sums[1] += (outputs.argmax(dim=1) == targets).sum().item()
            sums[3] += len(targets)
    model.train(was_training)
    dist.all_reduce(sums, group=group)
    loss_sum, correct, count, classified = sums.tolist()
    result = {"eval_loss": loss_sum / count if count else float("nan"), "eval_samples": int(count)}
    if classified and classified == count:
        result["eval_accuracy"] = correct / count
    return result
