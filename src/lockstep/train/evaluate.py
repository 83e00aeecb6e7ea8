"""Exact evaluation: every sample of the eval set counted once across ranks, with one collective in all.

The plain module runs (no DDP forward, so no collective per batch: ranks may hold
one sample more or less, since the eval sampler does not pad), and one all-reduce
of [loss sum, correct, count, classified] at the end makes the totals global.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lockstep.sampler import DistributedSampler


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_fn: Callable, data, make_loader: Callable, world_size: int, rank: int,
             batch_size: int, device: torch.device, autocast: Callable, group: dist.ProcessGroup | None,
             metric_fn: Callable | None = None) -> dict:
    """``eval_loss`` and ``eval_samples``, plus ``eval_accuracy`` when outputs are logits of class-index targets,
    plus ``eval_<name>`` for each value of ``metric_fn(outputs, targets)`` (a float, named ``metric``, or a dict).

    ``make_loader(data, sampler, batch_size, epoch)`` builds the DataLoader; ``autocast()`` the autocast context.
    A metric is a mean over its batch: weighted by the batch's size and summed here, it rides in the same
    all-reduce as the loss, so it is the exact mean over the eval set. Every rank must hold at least one
    eval sample (the metric names come from the batches).
    """
    sampler = DistributedSampler(data, world_size, rank, shuffle=False, pad=False)
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # NCCL reduces CUDA tensors only
    metric_sums: dict[str, float] = {}
    for inputs, targets in make_loader(data, sampler, batch_size, 0):
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast():
            outputs = model(inputs)
            loss = loss_fn(outputs, targets)
        sums[0] += loss.double().item() * len(targets)
        sums[2] += len(targets)
        if metric_fn is not None:
            values = metric_fn(outputs, targets)
            for name, value in (values.items() if isinstance(values, dict) else [("metric", values)]):
                metric_sums[name] = metric_sums.get(name, 0.0) + float(value) * len(targets)
        if outputs.ndim == 2 and targets.ndim == 1 and not targets.is_floating_point():
            sums[1] += (outputs.argmax(dim=1) == targets).sum().item()
            sums[3] += len(targets)
    model.train(was_training)
    names = sorted(metric_sums)  # the same order on every rank
    sums = torch.cat([sums, torch.tensor([metric_sums[n] for n in names], dtype=torch.float64, device=device)])
    dist.all_reduce(sums, group=group)
    loss_sum, correct, count, classified, *metric_totals = sums.tolist()
    result = {"eval_loss": loss_sum / count if count else float("nan"), "eval_samples": int(count)}
    result.update({f"eval_{name}": total / count for name, total in zip(names, metric_totals)})
    if classified and classified == count:
        result["eval_accuracy"] = correct / count
    return result
