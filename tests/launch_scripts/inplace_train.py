"""A Trainer run for the in-place recovery tests: global batch 16 over 1, 2 or 4 ranks, no checkpoint until the end.

Arguments: OUT_DIR [--max-steps N] [--pause-at STEP] [--pause-rank R] [--step-sleep S] [--alarms N]
``--pause-at``: after step STEP, launch rank R (default 2: the first rank of node 1 when nodes run 2 each)
writes OUT_DIR/paused and sleeps, so a test can kill node 1 while the others wait in step STEP + 1.
``--pause-here``: the pausing rank is this launch's first (LOCAL_RANK 0), whatever its launch rank (a node that
joined in place has ranks numbered after the others'). ``--save-every N``: a checkpoint every N steps (the
fence's generations, train/fence.py).
``--hold-until FILE``: every rank waits after step 2 (up to 120 s) until FILE exists (a test holds the job running
while it tries a second one into its folder).
``--pause-in-final-save``: rank R does so as the save after the last epoch starts (the others wait in its
collectives).
``--alarms N``: rank 0 raises the in-place alarm after every step until the group re-formed N times: every rank
drops its collectives and the group re-forms at the same size (the leak check's 10 recoveries in one process).
``--hold-at-world W``: the first step finished at world size W (in each generation of the in-place group: after
each shrink to W) is held (up to 120 s) until the agent stops the
workers (SIGTERM: a node joined; the Trainer checkpoints that step) or a node waits to join in place (the next
step's commit admits it), so a test can grow the job back. ``--refuse-joins``: the job admits no newcomer in place
(it withdraws what the Trainer said): a node that comes back makes every agent restart its workers.
``--note-joins``: during ``--step-sleep`` rank 0 writes OUT_DIR/join-ready once a node's ranks all announced
themselves and beat (its next commit would admit them).
Every rank appends "time step world_size pid" to OUT_DIR/progress-<pid>.txt after each step, and the
step, world size, generation, threads, sockets, descriptors and RSS (MiB) to OUT_DIR/resources-<pid>.txt
after each generation's first step.
The checkpoint at the end (OUT_DIR/ckpt-*.pt) holds the final parameters; with --max-steps it is a clean stop.
``--diloco H``: DiLoCo, every node on its own between outer syncs every H steps (``--diloco-fragments K``:
streaming, which in-place recovery refuses).
"""

import argparse
import os
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep import Trainer, TrainerConfig
from lockstep import keys

N, GLOBAL_BATCH, BATCH, EPOCHS = 96, 16, 4, 2


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def resources() -> str:
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # listdir's own descriptor, closed since
    rss_mb = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return f"{threading.active_count()} {sockets} {len(fds)} {rss_mb:.1f}"


def joins_ready(trainer) -> bool:
    """This rank's watcher saw a node's ranks all announced and beating: the next commit admits them."""
    return trainer._recovery is not None and trainer._recovery.group.joins.ready


def main():
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--pause-rank", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--alarms", type=int, default=0)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--hold-at-world", type=int, default=None)
    p.add_argument("--refuse-joins", action="store_true")
    p.add_argument("--note-joins", action="store_true", help="rank 0 writes OUT_DIR/join-ready in --step-sleep")
    p.add_argument("--pause-here", action="store_true", help="--pause-rank is this launch's LOCAL_RANK 0")
    p.add_argument("--save-every", type=int, default=None)
    p.add_argument("--hold-until", default=None, help="every rank waits after step 2 until this file exists")
    p.add_argument("--pause-in-final-save", action="store_true", help="pause rank --pause-rank in the last save")
    p.add_argument("--diloco", type=int, default=None, help="TrainerConfig.diloco_sync_every")
    p.add_argument("--diloco-fragments", type=int, default=1)
    args = p.parse_args()
    env = lockstep.init()
    launch_rank, pid = env.rank, os.getpid()
    try:
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        cfg = TrainerConfig(epochs=args.epochs, batch_size=BATCH, global_batch=GLOBAL_BATCH, warmup_steps=3, seed=5,
                            checkpoint_dir=args.directory, save_every_steps=args.save_every, keep_last=100,
                            progress=False,
                            resume=True, max_steps=args.max_steps, diloco_sync_every=args.diloco,
                            diloco_fragments=args.diloco_fragments,
                            sample_log_path=os.path.join(args.directory, f"samples-{pid}.jsonl"))
        sizes, held = [], []

        def on_step_end(trainer):
            with open(os.path.join(args.directory, f"progress-{pid}.txt"), "a") as f:
                f.write(f"{time.time():.3f} {trainer.step} {trainer.world_size} {pid}\n")
            group = trainer._recovery.group if trainer._recovery is not None else None
            generation = group.generation if group is not None else 0
            if not sizes or sizes[-1] != generation:
                sizes.append(generation)
                with open(os.path.join(args.directory, f"resources-{pid}.txt"), "a") as f:
                    f.write(f"{trainer.step} {trainer.world_size} {generation} {resources()}\n")
            if args.refuse_joins and trainer.rank == 0:  # no join in place: a node that comes back restarts all
                group.store.delete_key(keys.INPLACE_ACCEPTS_JOINS_KEY)
            if trainer.rank == 0 and generation < args.alarms:
                group.raise_alarm()  # once per generation (the first raise is kept)
            pauser = os.environ.get("LOCAL_RANK") == "0" if args.pause_here else launch_rank == args.pause_rank
            if args.pause_at == trainer.step and pauser:
                open(os.path.join(args.directory, "paused"), "w").close()
                time.sleep(3600)  # until the test kills this node
            if args.hold_at_world == trainer.world_size and generation not in held:  # once per re-formation
                held.append(generation)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (trainer._watch is not None and trainer._watch.requested):
                    if joins_ready(trainer):
                        break  # a node waits to join in place: the next commit admits it
                    time.sleep(0.2)  # until the agent stops the workers (SIGTERM: a node joined)
            if args.hold_until is not None and trainer.step == 2:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not os.path.exists(args.hold_until):
                    time.sleep(0.1)
            deadline = time.monotonic() + args.step_sleep
            while time.monotonic() < deadline:
                if args.note_joins and trainer.rank == 0 and joins_ready(trainer):
                    open(os.path.join(args.directory, "join-ready"), "w").close()
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

        trainer = Trainer(model, optimizer, nn.functional.cross_entropy, data(), None, cfg, on_step_end=on_step_end)
        if args.pause_in_final_save and launch_rank == args.pause_rank:
            save = trainer.save_checkpoint

            def pausing_save(*a, **kw):  # the save after the last epoch: the others wait in its collectives
                if trainer.epoch >= cfg.epochs:
                    open(os.path.join(args.directory, "paused"), "w").close()
                    time.sleep(3600)  # until the test kills this node
                return save(*a, **kw)

            trainer.save_checkpoint = pausing_save  # type: ignore[method-assign]
        trainer.fit()
        if trainer.rank == 0:
            print(f"done: step {trainer.step} world_size {trainer.world_size} accum {trainer.grad_accum_steps}",
                  file=sys.stderr, flush=True)
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
