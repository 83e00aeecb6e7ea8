"""Worker for test_faults: the Trainer on a small MLP, run under `lockstep launch`; writes its final state.

argv: DIR [--resume] [--step-sleep S] [--raise-in-forward STEP] [--exit-early STEP] [--n-train N]
Checkpoints go to DIR/ckpt, per-rank sample-id logs to DIR/samples-rank{rank}.jsonl, and each
rank's final parameters, optimizer state, sampler state and step to DIR/final-rank{rank}.pt.
The model has two DDP buckets (the first bucket holds 1 MiB), so a kill in backward lands
while one bucket's all-reduce is in flight and the other's gradients are still coming.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep import Trainer, TrainerConfig

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("--resume", action="store_true")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--raise-in-forward", type=int, default=None)
p.add_argument("--exit-early", type=int, default=None)
p.add_argument("--n-train", type=int, default=150)
args = p.parse_args()

torch.set_num_threads(1)
env = lockstep.init(backend="gloo", timeout_s=120)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(),
                                  nn.Linear(512, 3))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if args.raise_in_forward is not None and env.rank == 1 and trainer.step + 1 == args.raise_in_forward:
            raise RuntimeError(f"rank 1 fails in forward at step {args.raise_in_forward} (fault test)")
        return self.body(x)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def on_step_end(t):
    print(f"step {t.step} done rank={env.rank} pid={os.getpid()}", flush=True)
    if args.exit_early is not None and env.rank == 1 and t.step == args.exit_early:
        print(f"rank 1 exits 0 early after step {t.step} (fault test)", flush=True)
        sys.exit(0)
    if args.step_sleep:
        time.sleep(args.step_sleep)


torch.manual_seed(1 + 1000 * env.rank)  # ranks start apart; DDP's broadcast aligns them
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
config = TrainerConfig(epochs=3, batch_size=8, grad_accum_steps=2, grad_clip_norm=1.0, warmup_steps=4, seed=3,
                       checkpoint_dir=os.path.join(args.dir, "ckpt"), save_every_steps=2, keep_last=2,
                       progress=False, resume=args.resume or "TORCHELASTIC_RESTART_COUNT" in os.environ,
                       sample_log_path=os.path.join(args.dir, "samples-rank{rank}.jsonl"))
trainer = Trainer(model, optimizer, nn.functional.cross_entropy, data(args.n_train, 0), None, config,
                  on_step_end=on_step_end)
try:
    trainer.fit()
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "optimizer": optimizer.state_dict(),
                "sampler": trainer.sampler.state_dict(), "step": trainer.step, "epoch": trainer.epoch,
                "resumed_from": trainer.resumed_from,
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))},
               os.path.join(args.dir, f"final-rank{env.rank}.pt"))
    print(f"finished rank={env.rank} step={trainer.step} resumed_from={trainer.resumed_from}", flush=True)
finally:
    lockstep.shutdown()
