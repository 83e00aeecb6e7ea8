"""The Trainer with DiLoCo (``TrainerConfig.diloco_sync_every``): its groups, its checkpoint part, its numbers.

Inside a node the Trainer's DDP runs on the node's group (one rank a node: a group of one, whose all-reduce costs
nothing but its call); across nodes ``ddp.diloco.DiLoCo`` averages every H steps. What differs in a checkpoint:
between syncs every node holds its own parameters and inner optimizer state, so each rank's travels in its own
part of the checkpoint (``local_state``: gathered to global rank 0 with the sampler positions; world size x the
model and its optimizer in rank 0's memory while it writes), and the synced copy with the outer optimizer's state
once (``DiLoCo.state_dict``, the same on every rank). At another world size every rank starts from the synced copy:
the inner steps since the last sync are lost, as when a node is lost.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.ddp.diloco import DiLoCo, DiLoCoConfig, node_groups


@dataclass(frozen=True)
class DiLoCoGroups:
    """The inner DDP's group (this node's ranks) and DiLoCo's two (``node_groups``)."""

    ddp: dist.ProcessGroup | None
    node: dist.ProcessGroup | None
    cross: dist.ProcessGroup | None


def check_config(config: Any, group: dist.ProcessGroup | None, in_place: bool) -> None:
    """What of a TrainerConfig's DiLoCo the Trainer cannot run (its own fields are DiLoCoConfig's to check)."""
    if config.diloco_sync_every is None:
        return
    if group is not None:
        raise ValueError("TrainerConfig.diloco_sync_every: the default group only (group= is given)")
    if in_place and config.diloco_fragments > 1:
        raise ValueError(f"TrainerConfig.diloco_fragments={config.diloco_fragments} with in-place recovery: "
                         "streaming syncs its fragments at different steps, so no step holds a state every replica "
                         "agrees on to go back to; use diloco_fragments=1 or launch with --recovery restart (a "
                         "resume starts from the checkpoint)")


def make_groups() -> DiLoCoGroups:
    """The groups over the world, from the launcher's node ids (``ddp.diloco.node_groups``); every rank calls it,
    in the same order with its other ``new_group`` calls. One rank a node: the DDP on a group of its own rank."""
    node, cross = node_groups()
    if node is not None:
        return DiLoCoGroups(node, node, cross)
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # new_group is collective: all of them
    return DiLoCoGroups(singles[dist.get_rank()], None, None)


def build(model: torch.nn.Module, config: DiLoCoConfig, groups: DiLoCoGroups, init_sync: bool = True) -> DiLoCo:
    return DiLoCo(model, config, group=groups.cross, node_group=groups.node, init_sync=init_sync)


def snapshot(diloco: DiLoCo, optimizer: torch.optim.Optimizer, scheduler: Any, precision: Any) -> dict:
    """What in-place recovery rolls a rank back to (``rewind``): the last sync point, where every replica holds
    the anchors, so only this rank's inner optimizer (a copy: 2 x the parameters for Adam, every H steps),
    scheduler and scaler are kept, with DiLoCo's position. Off a sync point (the start of a run resumed mid-cycle,
    until its first sync) the parameters and DiLoCo's whole state too."""
    saved = {"optimizer": copy.deepcopy(optimizer.state_dict()),
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "scaler": precision.state_dict()}
    if diloco.at_sync_point:
        return {**saved, "diloco": diloco.position(), "params": None}
    return {**saved, "diloco": copy.deepcopy(diloco.state_dict()),  # its outer optimizer's state is referenced
            "params": [p.detach().clone() for p in diloco.params]}


def rewind(diloco: DiLoCo, optimizer: torch.optim.Optimizer, scheduler: Any, precision: Any, saved: dict) -> None:
    """This rank back at ``snapshot``'s point: the inner steps since are lost, as the issue allows a lost node."""
    diloco.rewind(saved["diloco"])
    if saved["params"] is not None:
        with torch.no_grad():
            for p, value in zip(diloco.params, saved["params"]):
                p.copy_(value)
    optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))  # kept intact for a second rollback to it
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    precision.load_state_dict(saved["scaler"], "(in-place recovery: this rank's last sync)")


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's own parameters and inner optimizer: what it resumes from at the same world size."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def load(diloco: DiLoCo, model: torch.nn.Module, optimizer: torch.optim.Optimizer, shared: dict,
         mine: dict | None) -> None:
    """``shared``: the checkpoint's DiLoCo state; ``mine``: this rank's ``local_state`` (None at another world size:
    every rank starts from the synced copy, the optimizer already loaded from rank 0's)."""
    diloco.load_state_dict(shared)
    if mine is None:
        diloco.reset_to_global()
    else:
        model.load_state_dict(mine["model"])
        optimizer.load_state_dict(mine["optimizer"])


def sync_metrics(diloco: DiLoCo | None) -> dict:
    """The last sync for the metrics line and the bar: after which inner step it landed, what it cost."""
    last = diloco.last_sync if diloco is not None else None
    if last is None:
        return {}
    return {"diloco_last_sync_step": last.landed_at, "diloco_last_sync_s": last.seconds,
            "diloco_wire_nbytes": diloco.wire_nbytes if diloco is not None else 0}


def sync_postfix(diloco: DiLoCo | None) -> dict[str, str]:
    """The bar's item: ``sync=<step>/<seconds>s``, the last sync's landing step and cost."""
    last = diloco.last_sync if diloco is not None else None
    return {} if last is None else {"sync": f"{last.landed_at}/{last.seconds:.2f}s"}
