"""A sharded optimizer's state as parts, one a rank, that merge into the state a plain optimizer has.

A part is a plain optimizer's ``state_dict`` (global parameter indices, the whole ``param_groups``) holding only
what one rank keeps: ZeRO-1's whole parameters (``ZeroRedundancyOptimizer.sharded_state_dict``), or ZeRO-2's
element ranges of parameters (``ZeroOptimizer.sharded_state_dict``), whose entries then carry ``RANGE`` (start and
stop in the flattened parameter), ``SHAPE`` and ``STRIDE`` (None: contiguous; else the ranges count in memory
order). ``merge_parts`` joins every rank's part of one step into the state dict a plain optimizer of the same class
has: what ``torch.optim.X.load_state_dict`` takes, and what either sharded optimizer's ``load_state_dict`` takes at
any world size (each keeps its own shard of it). The Trainer's ZeRO checkpoints are these parts, one file a rank
(``lockstep.train.zero``).

Cost of a merge: one copy of the whole state in host memory (it is what a plain optimizer holds).
"""

from __future__ import annotations

import math
from typing import Any

import torch

RANGE = "lockstep_range"
SHAPE = "lockstep_shape"
STRIDE = "lockstep_stride"  # a parameter laid out otherwise than contiguous (channels_last): ranges are in memory order


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's part of one step -> a plain optimizer's ``state_dict``; ValueError, naming the parameter index,
    where the parts do not fit together (a piece missing or held twice)."""
    if not parts:
        raise ValueError("merge_parts: no parts")
    groups = parts[0]["param_groups"]
    for rank, part in enumerate(parts[1:], 1):
        if [g["params"] for g in part["param_groups"]] != [g["params"] for g in groups]:
            raise ValueError(f"merge_parts: part {rank} numbers its parameter groups differently from part 0")
    pieces: dict[int, list[dict[str, Any]]] = {}
    for part in parts:
        for index, entry in part["state"].items():
            pieces.setdefault(int(index), []).append(entry)
    return {"state": {index: _join(index, entries) for index, entries in sorted(pieces.items())},
            "param_groups": groups}


def _join(index: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One parameter's state from its pieces: whole (one entry) or element ranges that tile the parameter."""
    if all(RANGE not in e for e in entries):
        if len(entries) > 1:
            raise ValueError(f"merge_parts: parameter {index}'s state is in {len(entries)} parts, whole in each")
        return entries[0]
    if any(RANGE not in e for e in entries):
        raise ValueError(f"merge_parts: parameter {index}'s state is whole in one part and in pieces in another")
    entries = sorted(entries, key=lambda e: e[RANGE][0])
    shape = tuple(entries[0][SHAPE])
    stop = 0
    for entry in entries:
        start, end = entry[RANGE]
        if start != stop:
            raise ValueError(f"merge_parts: parameter {index}'s pieces leave elements {stop}..{start} out or overlap")
        stop = end
    if stop != math.prod(shape):
        raise ValueError(f"merge_parts: parameter {index}'s pieces cover {stop} of its {math.prod(shape)} elements")
    merged: dict[str, Any] = {}
    for key, value in entries[0].items():
        if key in (RANGE, SHAPE, STRIDE):
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 1:  # a per-element state: the pieces in order
            joined = torch.cat([e[key] for e in entries])
            stride = entries[0].get(STRIDE)
            merged[key] = joined.reshape(shape) if stride is None else joined.as_strided(shape, tuple(stride))
        else:  # a scalar (Adam's step count) is the same in every piece
            merged[key] = value
    return merged
