"""The Trainer on preemptible nodes: a node lost, the others go on in place; the node back, it joins in place.

    lockstep launch --nnodes 1:2 --nproc-per-node 2 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        examples/elastic_trainer.py CHECKPOINT_DIR          # and the same with --node-rank 1 on the other node

Under ``lockstep launch --nnodes MIN:MAX`` (in-place recovery, the default) the Trainer's workers outlive a lost
node: the survivors re-form the group among themselves and go on from the last completed step at the smaller
world size, no checkpoint read, no step lost; a node whose launcher starts again joins the running group at a step
boundary and takes the state from rank 0. The launcher of each surviving node says so in one line (``node 1
(...) left at step N: world 4 -> 2 in T s, 0 steps lost``, ``... joined at step N: world 2 -> 4 ...``). What the
script gives for that is ``global_batch``: the accumulation steps follow the world size, so every step is the
same 64 samples at 2 ranks or 4 (the step line below shows the accumulation change), and each sample of an epoch
is used once across a resize. The checkpoints (``--save-every``, and at the end; ``resume=True``) are for the
restart path, which in-place recovery falls back to. ``examples/elastic_loop.py`` is the same job in a plain loop,
on the restart path. ``--step-time`` stands in for a larger model's step: time to stop a node by hand
(docs/preemptible.md, "Trying it on one machine").
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep import Trainer, TrainerConfig
from lockstep.train.data import digits_arrays  # scikit-learn's bundled digits, read without importing it

GLOBAL_BATCH, BATCH = 64, 8  # world sizes that can make it: 1, 2, 4, 8 (the accumulation steps: 8, 4, 2, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="checkpoints go here (every node writes its own: rank 0's node's are the job's)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.5, help="seconds each step takes at least (default 0.5)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps, and at the end")
    args = p.parse_args()
    lockstep.init()
    try:
        torch.manual_seed(0)
        pixels, labels = digits_arrays()
        data = TensorDataset(torch.tensor(pixels[:1792], dtype=torch.float32) / 16.0, torch.tensor(labels[:1792]))
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        config = TrainerConfig(epochs=args.epochs, batch_size=BATCH, global_batch=GLOBAL_BATCH, progress=False,
                               checkpoint_dir=args.directory, save_every_steps=args.save_every, resume=True)

        def on_step_end(trainer: Trainer) -> None:
            if trainer.is_writer and trainer.step % 10 == 0:  # global rank 0: one line for the job
                print(f"step {trainer.step}: world size {trainer.world_size}, {trainer.grad_accum_steps} "
                      f"micro-batches a rank", flush=True)
            time.sleep(args.step_time)

        Trainer(model, optimizer, nn.functional.cross_entropy, data, config=config, on_step_end=on_step_end).fit()
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
