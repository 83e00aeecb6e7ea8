"""Per-run experiment logs beside metrics.jsonl: a CSV file always, TensorBoard event files when installed.

Lightning's ``CSVLogger`` and ``TensorBoardLogger`` and Accelerate's trackers write one folder per
run; here the folder is ``<log_dir>/<run_id>/`` (``run_identity``), so a resumed run appends to its
own and a new run never mixes with an old one. Written by global rank 0 only, from the same
records as metrics.jsonl (``MetricsLog`` hands each one on).

The CSV is long-format, one row per number: ``step,epoch,event,name,value`` (a train row per
logged step, an epoch row per epoch metric), which appends without knowing every column up front;
``pandas.read_csv(...).pivot_table(index="step", columns="name", values="value")`` makes it wide.
TensorBoard gets the same numbers as scalars named ``<event>/<name>`` (``train/loss``, ``epoch/eval_loss``)
at the optimizer step. ``tensorboard`` is an optional extra (``pip install lockstep[tensorboard]``).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from pathlib import Path

_SKIP = {"event", "step", "epoch", "run"}


def _scalars(record: dict) -> list[tuple[str, float]]:
    """The record's numbers (bools, strings and None are not plotted)."""
    return [(k, float(v)) for k, v in sorted(record.items())
            if k not in _SKIP and isinstance(v, (int, float)) and not isinstance(v, bool)]


class CSVLogger:
    """Appends ``step,epoch,event,name,value`` rows to ``<folder>/metrics.csv`` (header once)."""

    def __init__(self, folder: Path):
        self.path = folder / "metrics.csv"
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(["step", "epoch", "event", "name", "value"])

    def write(self, record: dict) -> None:
        for name, value in _scalars(record):
            self._csv.writerow([record.get("step"), record.get("epoch"), record.get("event"), name, value])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """``SummaryWriter`` scalars ``<event>/<name>`` at the record's step, in ``<folder>``."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: dict) -> None:
        for name, value in _scalars(record):
            if math.isfinite(value):
                self.writer.add_scalar(f"{record.get('event')}/{name}", value, global_step=record.get("step"))
        self.writer.flush()  # a crash loses nothing already logged (one small write per record)

    def close(self) -> None:
        self.writer.close()


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def open_run_loggers(log_dir: str | os.PathLike, run_id: str, tensorboard: bool = True) -> list:
    """The CSV logger, and TensorBoard's when asked and installed, in ``<log_dir>/<run_id>/``."""
    folder = Path(log_dir) / run_id
    folder.mkdir(parents=True, exist_ok=True)
    loggers: list = [CSVLogger(folder)]
    if tensorboard and tensorboard_available():
        loggers.append(TensorBoardLogger(folder))
    return loggers
