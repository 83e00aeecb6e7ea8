"""Worker for test_launch: rank 1 raises after the group formed; rank 0 blocks in a collective that never completes."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("worker exploded on purpose (lockstep launch test)")
# Rank 0 waits on rank 1 forever: only the agent stopping the group ends it.
dist.all_reduce(torch.ones(1))
dist.barrier()
