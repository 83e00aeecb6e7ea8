"""Worker for test_multinode: the Trainer with checkpoints on a fixed problem; global rank 0 saves the result.

argv: out_dir [step_sleep_s]. Prints where it runs (rank, node's address, MASTER_ADDR, the gloo
interface) and one line per optimizer step; rank 0 writes out_dir/final.pt (parameters and
optimizer state) and every rank its sampler position. Checkpoints go to out_dir/ckpt, every
step, and a restarted group resumes from the newest (resume=True).
"""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep import Trainer, TrainerConfig

out_dir = sys.argv[1]
step_sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
if sys.argv[3:] == ["flat"]:  # the flat ring across nodes, as one node's: bit for bit with it
    lockstep.DistributedDataParallel.hierarchical_default = False
torch.set_num_threads(1)
env = lockstep.init(backend="gloo")
print(f"where rank={env.rank} local_rank={env.local_rank} world={env.world_size} "
      f"master={os.environ['MASTER_ADDR']} gloo_if={os.environ.get('GLOO_SOCKET_IFNAME')} "
      f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)

g = torch.Generator().manual_seed(0)
x = torch.randn(96, 8, generator=g)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
torch.manual_seed(1 + 1000 * env.rank)  # a different init per rank: DDP's broadcast must align them
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def on_step_end(trainer):
    print(f"step {trainer.step} rank={env.rank}", flush=True)
    time.sleep(step_sleep_s)  # stretches the run so that a test can cut the link mid-training


config = TrainerConfig(epochs=4, batch_size=4, seed=3, checkpoint_dir=os.path.join(out_dir, "ckpt"),
                       save_every_steps=1, keep_last=2, resume=True, progress=False)
trainer = Trainer(model, optimizer, nn.functional.cross_entropy, TensorDataset(x, y), None, config,
                  on_step_end=on_step_end)
try:
    trainer.fit()
    if env.rank == 0:
        torch.save({"params": [p.detach() for p in model.parameters()], "optimizer": optimizer.state_dict(),
                    "resumed_from": trainer.resumed_from, "hierarchical": trainer.ddp.reducer.hierarchy is not None},
                   os.path.join(out_dir, "final.pt"))
    print(f"done rank={env.rank} steps={trainer.step} resumed_from={trainer.resumed_from}", flush=True)
finally:
    lockstep.shutdown()
