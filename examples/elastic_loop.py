"""Your own DDP loop that survives losing (or regaining) a node: the same global batch, the same samples.

    lockstep launch --nnodes 1:2 --nproc-per-node 2 --node-rank 0 --master-addr HOST0 --master-port 29500 \
        --max-restarts 3 examples/elastic_loop.py CHECKPOINT_DIR          # and the same with --node-rank 1
    lockstep launch --nproc-per-node 2 examples/elastic_loop.py /tmp/ckpt --max-steps 20   # one node, then
    lockstep launch --nproc-per-node 1 examples/elastic_loop.py /tmp/ckpt                  # go on at 1 rank

What differs from a fixed-size loop is two calls (docs/preemptible.md):
  accum = lockstep.accumulation_steps(GLOBAL_BATCH, BATCH)       # micro-batches per step at this world size
  lockstep.resume(sampler, checkpoint["sampler"], checkpoint["step"])  # the epoch goes on where it stopped
and the checkpoint keeps the sampler's (global) state, written by rank 0 after an optimizer step. Run again, it
resumes from that checkpoint, rank 0 says where in one line, and a run whose checkpoint is its last step says so
and exits 0.
"""

import argparse
import contextlib
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.train.data import digits_arrays  # scikit-learn's bundled digits, read without importing it

GLOBAL_BATCH, BATCH = 64, 8  # any world size that divides 64 / 8 = 8: 1, 2, 4 or 8 ranks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    args = p.parse_args()
    try:  # every rank (every node has its own disk), before the group: a bad path costs no start-up
        os.makedirs(args.directory, exist_ok=True)
    except OSError as e:
        message = f"elastic_loop.py: cannot create the checkpoint directory {args.directory}: {e.strerror}"
        raise SystemExit(message) from None
    env = lockstep.init()
    try:
        torch.manual_seed(0)
        pixels, labels = digits_arrays()
        x, y = torch.tensor(pixels, dtype=torch.float32) / 16.0, torch.tensor(labels)
        dataset = TensorDataset(x[:1792], y[:1792])  # 28 global batches: every step is a whole one
        sampler = lockstep.DistributedSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        model = lockstep.DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

        accum = lockstep.accumulation_steps(GLOBAL_BATCH, BATCH)  # call 1: 8 at 1 rank, 4 at 2, 2 at 4
        step, epoch, path = 0, 0, os.path.join(args.directory, "checkpoint.pt")
        if os.path.exists(path):
            step, epoch = resume_from(path, model, optimizer, sampler, accum, env)
            left = nothing_left(step, epoch, args)
            if left:  # every rank read the same checkpoint: all of them stop here, together
                if env.rank == 0:
                    print(left)
                return

        while epoch < args.epochs:
            sampler.set_epoch(epoch)  # keeps a resumed position when it is the epoch just loaded
            for i, (inputs, targets) in enumerate(loader):
                sync = (i + 1) % accum == 0
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = nn.functional.cross_entropy(model(inputs), targets)
                    (loss / accum).backward()
                sampler.advance(len(targets))  # what the loop consumed (a prefetching loader runs ahead)
                if not sync:
                    continue
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if env.rank == 0 and step % 5 == 0:  # the sampler's state is global: rank 0's is every rank's
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "step": step, "epoch": epoch, "sampler": sampler.state_dict()}
                    torch.save(state, path + ".tmp")
                    os.replace(path + ".tmp", path)  # atomic: a kill mid-save leaves the previous one
                if args.max_steps is not None and step >= args.max_steps:
                    return
            epoch += 1  # epochs done; printed 1-based, as the Trainer does
            if env.rank == 0:
                print(f"epoch {epoch} done at step {step}, loss {loss.item():.4f}")
    finally:
        lockstep.shutdown()


def resume_from(path, model, optimizer, sampler, accum, env):
    """Load the checkpoint; rank 0 says where the run resumes. Returns (step, the epoch to train next)."""
    checkpoint = torch.load(path, weights_only=True)
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    step, epoch = checkpoint["step"], checkpoint["epoch"]
    sampler.set_epoch(epoch)
    position = lockstep.resume(sampler, checkpoint["sampler"], step)  # call 2: at whatever world size this is
    # A checkpoint written at an epoch's last step has all of it consumed: that epoch is done, the next one is due.
    done = position >= len(sampler.dataset)
    where = f"epoch {epoch + 1} done" if done else f"epoch {epoch + 1}, sample {position} of {len(sampler.dataset)}"
    if env.rank == 0:
        print(f"resumed from step {step} ({where}) out of {path}: world size {env.world_size}, {accum} micro-batches "
              f"per step; saved by {checkpoint['sampler']['num_replicas']} ranks")
    return step, epoch + 1 if done else epoch


def nothing_left(step, epoch, args):
    """Why a resumed run has nothing to train (its checkpoint is the final one), or "" when it has."""
    if args.max_steps is not None and step >= args.max_steps:
        return f"nothing to train: the checkpoint is at step {step}, --max-steps {args.max_steps}; raise it to go on"
    if epoch >= args.epochs:
        return f"nothing to train: the checkpoint finished epoch {epoch} of --epochs {args.epochs}; raise it to go on"
    return ""


if __name__ == "__main__":
    main()
