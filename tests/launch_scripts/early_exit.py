"""Worker for test_launch_reports: rank 1 wraps the model, then leaves with exit code 0 before the first step
(as `if rank == 0: trainer.fit()` does); rank 0 trains and meets no peer."""

import sys

import torch

import lockstep

env = lockstep.init()
model = lockstep.DistributedDataParallel(torch.nn.Linear(2, 1))
if env.rank == 1:
    sys.exit(0)
for _ in range(3):
    model(torch.ones(4, 2)).sum().backward()
