"""A plain training loop with ``lockstep.InPlaceRecovery`` (docs/preemptible.md, "Your own loop").

Arguments: OUT_DIR [--alarms N] [--die-at STEP --die-rank R]
Every rank logs {"step", "epoch", "ids", "world"} per step to OUT_DIR/samples-<pid>.jsonl; rank 0 saves the final
parameters to OUT_DIR/final.pt. ``--alarms N``: rank 0 raises the in-place alarm after each step until the group
re-formed N times (same size). ``--die-at``: launch rank R kills itself (SIGKILL) after step STEP.
"""

import argparse
import json
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep

N, BATCH, EPOCHS = 48, 2, 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--alarms", type=int, default=0)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-rank", type=int, default=None)
    args = p.parse_args()
    env = lockstep.init()
    launch_rank = env.rank
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, 6, generator=g)
        data = TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(N))
        torch.manual_seed(7)
        ddp = lockstep.DistributedDataParallel(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        sampler = lockstep.DistributedSampler(data, env.world_size, env.rank, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
        recovery = lockstep.InPlaceRecovery(ddp, optimizer, sampler)
        log = open(os.path.join(args.directory, f"samples-{os.getpid()}.jsonl"), "a", buffering=1)
        for epoch in range(EPOCHS):
            recovery.set_epoch(epoch)
            done = False
            while not done:
                try:
                    for inputs, targets, ids in loader:
                        recovery.step(lambda: nn.functional.cross_entropy(ddp(inputs), targets).backward())
                        log.write(json.dumps({"step": recovery.step_count, "epoch": epoch, "ids": ids.tolist(),
                                              "world": sampler.num_replicas}) + "\n")
                        if args.die_at == recovery.step_count and launch_rank == args.die_rank:
                            os.kill(os.getpid(), signal.SIGKILL)
                        if sampler.rank == 0 and recovery.group.generation < args.alarms:
                            recovery.group.raise_alarm()
                    done = True
                except lockstep.PeerLost:
                    pass  # the group re-formed: iterate the loader again, from the last committed position
        recovery.group.stop()
        if sampler.rank == 0:
            torch.save(ddp.module.state_dict(), os.path.join(args.directory, "final.pt"))
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
