"""Worker for test_launch_reports: lockstep's Trainer with a checkpoint every 5 steps, training until it is stopped."""

import sys

import torch
from torch.utils.data import TensorDataset

import lockstep

lockstep.init()
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
config = lockstep.TrainerConfig(epochs=1_000_000, batch_size=8, checkpoint_dir=sys.argv[1], save_every_steps=5,
                                keep_last=2, progress=False)
try:
    lockstep.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.functional.cross_entropy,
                     data, None, config).fit()
finally:
    lockstep.shutdown()
