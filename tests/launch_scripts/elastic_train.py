"""A Trainer run for the elastic tests: global batch 16 over any of 1, 2 or 4 ranks, a checkpoint every step.

Arguments: CHECKPOINT_DIR [--max-steps N] [--pause-at STEP] [--step-sleep S]
``--pause-at``: after checkpoint STEP, global rank 2 (the first rank of node 1 when nodes run 2 each)
writes CHECKPOINT_DIR/paused and sleeps, so a test can kill node 1 at an exact step.
``--hold-at-world W``: the first step finished at world size W is held (up to 120 s) until the agent stops
the workers (SIGTERM: a node joined), so a test can grow the job before it ends.
Every rank appends "time step world_size" to CHECKPOINT_DIR/progress-<rank>.txt after each step.
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

N, GLOBAL_BATCH, BATCH, EPOCHS = 96, 16, 4, 2


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hold-at-world", type=int, default=None)
    args = p.parse_args()
    env = lockstep.init()
    try:
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        cfg = TrainerConfig(epochs=EPOCHS, batch_size=BATCH, global_batch=GLOBAL_BATCH, warmup_steps=3, seed=5,
                            checkpoint_dir=args.directory, save_every_steps=1, keep_last=100, progress=False,
                            resume=True, max_steps=args.max_steps,
                            sample_log_path=os.path.join(args.directory, "samples-{rank}.jsonl"))

        held = []

        def on_step_end(trainer):
            with open(os.path.join(args.directory, f"progress-{env.rank}.txt"), "a") as f:
                f.write(f"{time.time():.3f} {trainer.step} {trainer.world_size}\n")
            if args.pause_at == trainer.step and env.rank == 2:
                open(os.path.join(args.directory, "paused"), "w").close()
                time.sleep(3600)  # until the test kills this node
            if args.hold_at_world == trainer.world_size and not held:
                held.append(trainer.step)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (trainer._watch is not None and trainer._watch.requested):
                    time.sleep(0.2)  # the checkpoint of this step is written: the SIGTERM may come
            time.sleep(args.step_sleep)

        trainer = Trainer(model, optimizer, nn.functional.cross_entropy, data(), None, cfg, on_step_end=on_step_end)
        if env.rank == 0:
            print(f"start: step {trainer.step} world_size {trainer.world_size}", file=sys.stderr, flush=True)
        trainer.fit()
        if env.rank == 0:
            print(f"done: step {trainer.step} world_size {trainer.world_size} accum {trainer.grad_accum_steps} "
                  f"resized_from {trainer.resized_from}", file=sys.stderr, flush=True)
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
