"""``lockstep demo``: a small CNN learns scikit-learn's handwritten digits with DDP on 2 CPU processes.

The workers are started by ``lockstep.launch.launcher.launch_function`` (torch's elastic agent),
each joins the gloo group with ``lockstep.init()`` and trains with ``lockstep.Trainer``.
Rank 0 prints one line per epoch (the Trainer's; its eval set is the test split); the parent process then
draws the loss and accuracy curves from ``metrics.jsonl`` and prints ``test accuracy 0.97`` as its last line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, two linear layers: ~40k parameters for 8x8 images."""

    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(64, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _end_epoch(trainer, record: dict) -> None:
    # the epoch's line (train loss, eval loss and accuracy on the test split, samples/s) is the Trainer's;
    # a checkpoint per epoch (keep_last=1: one file): Ctrl-C loses at most the epoch under way
    trainer.save_checkpoint()


def train_worker(out_dir: str, epochs: int, batch_size: int, lr: float, seed: int, resume: bool = False,
                 overwrite: bool = False) -> dict:
    """One rank of the demo (module-level: the launcher's workers import it by name)."""
    from lockstep.process_group import init, shutdown
    from lockstep.train.data import digits_datasets
    from lockstep.train.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)  # ranks share the machine's cores; more threads per rank only contend
    env = init(backend="gloo")
    try:
        torch.manual_seed(seed)
        train_data, test_data = digits_datasets(seed=seed)
        model = DigitsCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        config = TrainerConfig(
            epochs=epochs, batch_size=batch_size, seed=seed, checkpoint_dir=out_dir, keep_last=1,
            resume=resume, overwrite=overwrite,
            metrics_path=os.path.join(out_dir, "metrics.jsonl"), log_every_steps=5,
            progress=True,  # off a terminal (under the launcher) a line per epoch and every 10 s, with step time
        )
        trainer = Trainer(model, optimizer, nn.functional.cross_entropy, train_data, test_data, config,
                                   device=torch.device("cpu"), on_epoch_end=_end_epoch)
        summary = trainer.fit()
        if not summary["samples_per_s"]:  # resumed with nothing left: the Trainer said so (rank 0), nothing to add
            return {"summary": summary, "comm": None, "world_size": env.world_size}
        if not trainer.history:  # resumed within the last epoch (no epoch summary): evaluate what it has
            summary["eval_accuracy"] = trainer.evaluate()["eval_accuracy"]
        comm = trainer.comm_report()
        if env.rank == 0:
            print(f"{env.world_size} ranks, {summary['samples_per_s']:.0f} samples/s; "
                  f"share of step time spent in communication: {100 * comm['comm_share']:.1f}% ({comm['method']})",
                  flush=True)
        return {"summary": summary, "comm": comm, "world_size": env.world_size}
    finally:
        shutdown()


def draw_curves(epochs: dict[int, dict]):
    """The figure of ``plot_curves`` from epoch records keyed by their 1-based epoch; the caller closes it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    xs = sorted(epochs)  # 1-based, as printed
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(xs, [epochs[e]["train_loss"] for e in xs], marker="o", label="train")
    ax_loss.plot(xs, [epochs[e]["eval_loss"] for e in xs], marker="o", label="test")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(xs, [epochs[e]["eval_accuracy"] for e in xs], marker="o", color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="test accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):  # whole epochs only: a 2-epoch run had ticks at 1.2, 1.4, ...
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    """Training loss and test accuracy per epoch, side by side (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lockstep.train.metrics import read_metrics, select_run

    # this run's records only (an older run in the same file is another curve); a resumed epoch: last wins
    epochs = {r["epoch"]: r for r in select_run(read_metrics(metrics_path)) if r.get("event") == "epoch"}
    fig = draw_curves(epochs)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401  (~0.1 s; asked before training, not after it)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet_signal_shutdown():
    """Drop torch's elastic-agent warnings about shutting workers down on a signal ("Received 2 death signal",
    "Closing process ... via signal SIGINT"): the demo says it in one line of its own."""
    import logging

    def chatter(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Received %s death signal", "Closing process %s via signal"))

    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic.agent.server.api",
                                                      "torch.distributed.elastic.multiprocessing.api")]
    for logger in loggers:
        logger.addFilter(chatter)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(chatter)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lockstep demo", description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) to train on (default 2)")
    p.add_argument("--epochs", type=int, default=None,
                   help="passes over the training set (default 12; with --resume, the resumed run's own)")
    p.add_argument("--out", default=None, help="output directory (default runs/<timestamp>)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step per rank (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    again.add_argument("--overwrite", action="store_true",
                       help="start a new run in --out, deleting the checkpoints of the run there")
    ns = p.parse_args(list(argv))
    for name in ("nproc", "epochs", "batch_size"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if not ns.lr > 0:
        p.error(f"--lr must be > 0, got {ns.lr}")
    return ns


DEFAULT_EPOCHS = 12


def _epochs_to_train(ns: argparse.Namespace, out_dir: Path) -> tuple[int, str | None]:
    """The epochs the run trains up to, and the line that says there is nothing left (None: there is).

    Without --epochs a resumed run trains to the target of the run it continues (kept in its checkpoint), so
    the Ctrl-C hint `--resume --out DIR` finishes what was started; --epochs sets a new target."""
    if not ns.resume:
        return ns.epochs or DEFAULT_EPOCHS, None
    from lockstep.train.checkpoint_files import load_checkpoint, newest_good_checkpoint

    good, _ = newest_good_checkpoint(out_dir)  # the one the Trainer will resume from (it warns about bad ones)
    if good is None:
        return ns.epochs or DEFAULT_EPOCHS, None
    saved = load_checkpoint(good)
    epochs = ns.epochs or saved.get("target_epochs") or DEFAULT_EPOCHS  # older checkpoints kept no target
    if saved["epoch"] < epochs:
        return epochs, None
    done = saved["epoch"]
    return epochs, (f"lockstep demo: nothing to train: the checkpoint {good} finished epoch {done} of {epochs}; "
                    f"to train 2 more: {_continue_command(ns, out_dir)} --epochs {done + 2}")


def _continue_command(ns: argparse.Namespace, out_dir: Path) -> str:
    """The command that trains the rest of an interrupted run: its data split (--seed), layout and batch; the
    target epochs come from the checkpoint, and --lr from the optimizer state it holds."""
    flags = [f"--{name.replace('_', '-')} {getattr(ns, name)}" for name, default in
             (("nproc", 2), ("batch_size", 32), ("seed", 0)) if getattr(ns, name) != default]
    return " ".join(["lockstep demo --resume --out", str(out_dir), *flags])


def cli_main(argv: Sequence[str]) -> int:
    """Run the demo; returns 0 on success (the last line printed is ``test accuracy 0.97``)."""
    try:
        ns = _parse(argv)
    except SystemExit as e:
        return int(e.code or 0)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from lockstep.launch.launcher import LaunchError, launch_function
    from lockstep.train.checkpoint_files import newest_good_checkpoint, probe_writable

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(ns.out) if ns.out else Path("runs") / stamp
    try:  # before any rank starts: a folder nobody can write to is one line, not a traceback 30 s in
        probe_writable(out_dir)
    except OSError as e:
        cause = e.__cause__ if isinstance(e.__cause__, OSError) else e  # probe_writable's message names the config
        print(f"lockstep demo: --out {out_dir} is not writable: {cause.strerror or cause}", file=sys.stderr)
        return 2
    if not (ns.resume or ns.overwrite):  # checked here too, so the answer comes before any rank starts
        from lockstep.train.run_identity import conflict_message, foreign_checkpoints

        foreign = foreign_checkpoints(out_dir, None)
        if foreign:
            print("lockstep demo: " + conflict_message(out_dir, foreign, "continue it with --resume, choose a new "
                                                       "--out, or replace it with --overwrite"), file=sys.stderr)
            return 2
    epochs, nothing_left = _epochs_to_train(ns, out_dir)
    if nothing_left:  # said before any rank starts: a finished run is not an error
        print(nothing_left, flush=True)
        return 0
    plotting = _have_matplotlib()
    print(f"lockstep demo: CNN on scikit-learn digits, {ns.nproc} CPU processes, {epochs} epochs -> {out_dir}",
          flush=True)
    if not plotting:
        print("lockstep demo: matplotlib is not installed, so no curves.png (pip install matplotlib); "
              "training goes on", file=sys.stderr, flush=True)
    try:
        with _quiet_signal_shutdown():
            results = launch_function(
                train_worker,
                args=(str(out_dir.resolve()), epochs, ns.batch_size, ns.lr, ns.seed, ns.resume, ns.overwrite),
                nproc_per_node=ns.nproc,
                log_rank=0,
            )
    except LaunchError as e:
        print(f"lockstep demo: training failed: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException) as e:  # Ctrl-C (or a kill): the agent has stopped the workers
        sig = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.Signals(e.sigval)
        good, _ = newest_good_checkpoint(out_dir)
        kept = (f"the last checkpoint {good} is intact; continue with: {_continue_command(ns, out_dir)}" if good
                else "no checkpoint was written yet")
        print(f"lockstep demo: stopped by {sig.name}; {kept}", file=sys.stderr)
        return 128 + sig.value
    result = results[0]
    if result["comm"] is None:  # resumed with nothing left (rank 0 said so): not an error
        return 0
    png = out_dir / "curves.png"
    written = [str(out_dir / "metrics.jsonl"), str(result["summary"]["last_checkpoint"])]
    if plotting:
        plot_curves(out_dir / "metrics.jsonl", png)
        written.append(str(png))
    print(f"wrote {', '.join(written)}")
    print(f"test accuracy {result['summary']['eval_accuracy']:.2f}")
    return 0
