"""Worker for test_launch_reports: a lockstep DDP model that trains until it is stopped (its hang watchdog runs)."""

import os
import time

import torch

import lockstep

env = lockstep.init()
model = lockstep.DistributedDataParallel(torch.nn.Linear(2, 1))
print(f"worker pid {os.getpid()}", flush=True)
while True:
    model(torch.ones(4, 2)).sum().backward()
    time.sleep(0.2)
