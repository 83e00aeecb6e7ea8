"""Wine classification with lockstep: the classic tutorial workflow, trained data-parallel.

load_wine -> standard scaling (fitted on the training split) -> a 13-64-3 MLP -> Adam,
trained by ``lockstep.Trainer`` on every rank, with a checkpoint every ``--save-every``
epochs. Run it with either launcher:

    lockstep launch --nproc-per-node 2 examples/wine.py --epochs 30
    torchrun --standalone --nproc-per-node 2 examples/wine.py --epochs 30

and add ``--resume`` to continue from the newest checkpoint in ``--out``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import lockstep
from lockstep.train import RunConflictError
from lockstep.train.data import wine_datasets


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N epochs (and at the end)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--out", default="runs/wine", help="checkpoints and metrics.jsonl go here")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    again.add_argument("--overwrite", action="store_true", help="start a new run in --out, deleting the run there")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    env = lockstep.init()  # reads RANK / WORLD_SIZE / MASTER_ADDR... from lockstep launch or torchrun
    log = lockstep.get_logger("wine")
    try:
        torch.manual_seed(args.seed)
        train_data, test_data = wine_datasets(seed=args.seed)
        model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        config = lockstep.TrainerConfig(
            epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, checkpoint_dir=args.out,
            keep_last=3, metrics_path=f"{args.out}/metrics.jsonl", progress=False, overwrite=args.overwrite,
        )

        def every_few_epochs(trainer: lockstep.Trainer, record: dict) -> None:
            epoch = record["epoch"]  # 1-based, as the progress bar and metrics.jsonl count
            if epoch % args.save_every == 0:
                path = trainer.save_checkpoint()  # every rank calls it; global rank 0 writes
                log.info("epoch %d: train loss %.4f, test accuracy %.3f, saved %s",
                         epoch, record["train_loss"], record["eval_accuracy"], path)

        trainer = lockstep.Trainer(model, optimizer, nn.functional.cross_entropy, train_data, test_data, config,
                                   on_epoch_end=every_few_epochs)
        if args.resume:  # the same as TrainerConfig(resume=True), but we can say where from
            log.info("resuming from %s", trainer.load_latest() or "nothing (no checkpoint yet)")
        try:
            summary = trainer.fit()
        except RunConflictError as e:  # --out holds another run: every rank stops here, before step 1
            if env.rank == 0:
                print(f"wine.py: {e.directory} holds checkpoints of another run ({', '.join(p.name for p in e.files)}): "
                      f"continue it with --resume, choose a new --out, or replace it with --overwrite", file=sys.stderr)
            raise SystemExit(2) from None
        accuracy = trainer.evaluate()["eval_accuracy"]  # also right when a resumed run had no epoch left
        if env.rank == 0:
            print(f"{env.world_size} ranks, {summary['steps']} steps, {summary['samples_per_s']:.0f} samples/s")
            print(f"test accuracy {accuracy:.2f}", flush=True)
    finally:
        lockstep.shutdown()


if __name__ == "__main__":
    main()
