"""The DDP wrapper and everything it is made of.

``wrapper`` is the ``nn.Module`` users hold (``DistributedDataParallel``); ``reducer``
and ``reducer_state`` average gradients in buckets during backward; ``buckets``
plans the buckets; ``graph`` finds the end of backward and unused parameters;
``grad_bucket`` is the bucket a comm hook sees; ``join`` handles uneven inputs;
``args`` checks the constructor's arguments; ``replicas`` checks and broadcasts
the replicas at start-up; ``naive`` is the one-all-reduce-per-parameter reference.
"""

from lockstep.ddp.naive import NaiveDistributedDataParallel
from lockstep.ddp.wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel", "NaiveDistributedDataParallel"]
