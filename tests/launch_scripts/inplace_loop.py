"""A plain training loop with ``lockstep.InPlaceRecovery`` (docs/preemptible.md, "Your own loop").

Arguments: OUT_DIR [--alarms N] [--die-at STEP --die-rank R] [--pause-at STEP --pause-rank R] [--hold-at-world W]
[--max-steps N] [--commit-fails-at STEP --commit-fails-rank R]
Every rank logs {"step", "epoch", "ids", "world"} per step to OUT_DIR/samples-<pid>.jsonl and "time step world pid"
to OUT_DIR/progress-<pid>.txt; rank 0 saves the final parameters to OUT_DIR/final.pt. ``--alarms N``: rank 0 raises
the in-place alarm after each step until the group re-formed N times (same size). ``--die-at``: launch rank R kills
itself (SIGKILL) after step STEP. ``--pause-at``: launch rank R writes OUT_DIR/paused after step STEP and sleeps (a
test kills its node). ``--hold-at-world W``: the first step at world size W (in each generation) is held, up to 120
s, until a node waits to join in place (the next step boundary admits it). ``--max-steps N``: a clean stop after step
N, rank 0 saving OUT_DIR/ckpt.pt (model, optimizer, LR scheduler, sampler, step); a run that finds one resumes from
it (the reference a lost-and-back run is compared with). ``--commit-fails-at``: launch rank R's commit of step
STEP completes (the others commit it) and then reports a failure, as a link that broke right after would: R rejoins,
the others fail their next step, and R applies step STEP itself (roll forward). A process that joins a running job in place runs this same
script: nothing in it differs.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep

N, BATCH, EPOCHS = 48, 2, 2


def _fail_after_the_next_commit() -> None:
    """The next one-element all-reduce (this step's commit) completes, then raises as a broken link would."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if tensor.numel() != 1:
            return real(tensor, *args, **kwargs)
        dist.all_reduce = real
        real(tensor, *args, **kwargs)
        raise dist.DistError("inplace_loop.py: the commit completed here, then the link broke (injected)")

    dist.all_reduce = all_reduce


def main():
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--alarms", type=int, default=0)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-rank", type=int, default=None)
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--pause-rank", type=int, default=None)
    p.add_argument("--hold-at-world", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--commit-fails-at", type=int, default=None)
    p.add_argument("--commit-fails-rank", type=int, default=None)
    args = p.parse_args()
    env = lockstep.init()
    launch_rank, pid = env.rank, os.getpid()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, 6, generator=g)
        data = TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(N))
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)  # a newcomer takes its state
        sampler = lockstep.DistributedSampler(data, env.world_size, env.rank, shuffle=True, seed=3)
        checkpoint, start_epoch, start_step = os.path.join(args.directory, "ckpt.pt"), 0, 0
        if os.path.exists(checkpoint):  # the reference's resume ("Your own loop: two calls")
            saved = torch.load(checkpoint, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            start_epoch, start_step = saved["sampler"]["epoch"], saved["step"]
            sampler.set_epoch(start_epoch)
            lockstep.resume(sampler, saved["sampler"], start_step)
        ddp = lockstep.DistributedDataParallel(model, hierarchical_all_reduce=False)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
        recovery = lockstep.InPlaceRecovery(ddp, optimizer, sampler, scheduler=scheduler)
        if start_step:
            recovery.step_count = start_step
        log = open(os.path.join(args.directory, f"samples-{pid}.jsonl"), "a", buffering=1)
        held = []
        for epoch in range(start_epoch, EPOCHS):
            recovery.set_epoch(epoch)
            done = False
            while not done:
                try:
                    for inputs, targets, ids in loader:
                        if args.commit_fails_at == recovery.step_count + 1 and launch_rank == args.commit_fails_rank:
                            _fail_after_the_next_commit()
                            args.commit_fails_at = None
                        recovery.step(lambda: nn.functional.cross_entropy(ddp(inputs), targets).backward())
                        scheduler.step()
                        step, world = recovery.step_count, sampler.num_replicas
                        log.write(json.dumps({"step": step, "epoch": epoch, "ids": ids.tolist(), "world": world})
                                  + "\n")
                        with open(os.path.join(args.directory, f"progress-{pid}.txt"), "a") as f:
                            f.write(f"{time.time():.3f} {step} {world} {pid}\n")
                        if args.die_at == step and launch_rank == args.die_rank:
                            os.kill(os.getpid(), signal.SIGKILL)
                        if sampler.rank == 0 and recovery.group.generation < args.alarms:
                            recovery.group.raise_alarm()
                        if args.pause_at == step and launch_rank == args.pause_rank:
                            open(os.path.join(args.directory, "paused"), "w").close()
                            time.sleep(3600)  # until the test kills this node
                        if args.hold_at_world == world and recovery.group.generation not in held:
                            held.append(recovery.group.generation)
                            deadline = time.monotonic() + 120
                            while time.monotonic() < deadline and not recovery.group.joins.ready:
                                time.sleep(0.1)  # a node waits to join: the next step's commit admits it
                        if step == args.max_steps:
                            if sampler.rank == 0:
                                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                            "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
                                            "step": step}, checkpoint)
                            recovery.group.stop()
                            return
                    done = True
                except lockstep.PeerLost as lost:  # the group re-formed: iterate the loader again, from the last
                    # committed position
                    print(f"re-formed after step {lost.outcome.committed}, rolled forward: "
                          f"{lost.outcome.rolled_forward}", flush=True)
        recovery.group.stop()
        if sampler.rank == 0:
            torch.save(ddp.module.state_dict(), os.path.join(args.directory, "final.pt"))
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
