"""Worker for test_launch_reports: rank 0 fails on a missing import after the group formed (lockstep.init
logs its INFO line first); rank 1 then fails in its all-reduce on the closed connection."""

import torch
import torch.distributed as dist

import lockstep

env = lockstep.init()
if env.rank == 0:
    import no_such_module_for_lockstep_tests  # noqa: F401
dist.all_reduce(torch.ones(1))
