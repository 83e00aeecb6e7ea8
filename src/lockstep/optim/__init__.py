"""Optimizers that know about the process group: ``ZeroRedundancyOptimizer`` (ZeRO stage 1).

A part of its own below ``ddp/`` (layer 3): it needs torch.distributed only, so the wrapper's ZeRO-2 may use its
partition (``partition_parameters``) and its state-dict layout without an import cycle.
"""

from lockstep.optim.state_parts import merge_parts
from lockstep.optim.zero import ZeroRedundancyOptimizer, partition_parameters

__all__ = ["ZeroRedundancyOptimizer", "merge_parts", "partition_parameters"]
