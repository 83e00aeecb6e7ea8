"""A tiny DDP run under `lockstep launch` with LOCKSTEP_TRACE set, of argv[2] steps, ended one of four ways (argv[1]):

  shutdown  try/finally lockstep.shutdown(), as examples/debugging.py: shutdown writes
  exit      the script returns without lockstep.shutdown() or destroy_process_group(): atexit writes
  raise     every rank raises after step 3, no shutdown: atexit writes, on failure
  finally   every rank raises after step 3 inside try/finally lockstep.shutdown(): shutdown writes, on failure
"""

import sys

import torch
import torch.nn.functional as F

import lockstep

ending, steps = sys.argv[1], int(sys.argv[2])
env = lockstep.init()
torch.manual_seed(0)
model = lockstep.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))


def train(steps: int) -> None:
    for step in range(1, steps + 1):
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        if step == 3 and ending in ("raise", "finally"):
            raise RuntimeError("boom at step 3")


if ending in ("shutdown", "finally"):
    try:
        train(steps)
    finally:
        lockstep.shutdown()
else:
    train(steps)
