"""The Trainer's rank-0 progress bar: tqdm on a terminal, and a line every few seconds when output is forwarded.

Under ``lockstep launch`` (or any redirection) stderr is a pipe or a file, and tqdm's in-place updates
(carriage returns, no newline) reach the launcher's line-by-line forwarding only when the bar closes,
so a person saw nothing between epochs. Off a terminal the bar therefore writes each refresh as a
line of its own, at most once every ``forwarded_interval_s``. The postfix carries the step time and
the communication share (the all-reduce wait over the step time, from ``ddp.comm_stats()``). The lines a
resumed run prints first (where it resumed, or that nothing is left to train) are here too.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, TextIO


class _LinePerRefresh:
    """A file for tqdm that turns each carriage-return refresh into a line (for pipes and log files)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "")
        if text.strip():
            self.stream.write(text.rstrip("\n") + "\n")

    def flush(self) -> None:
        self.stream.flush()


@functools.cache  # one class: tqdm keeps a monitor thread per class, so a class per bar leaked one thread per epoch
def _forwarded_bar_class():
    from tqdm import tqdm

    class ForwardedBar(tqdm):
        """Always ends with the final line, even for an epoch shorter than the refresh interval, and with the
        final numbers (the Trainer sets the epoch's all-rank loss just before closing)."""

        _shown: tuple | None = None

        def display(self, *args, **kwargs):
            self._shown = (self.n, self.postfix)
            return super().display(*args, **kwargs)

        def close(self) -> None:
            if not self.disable and self._shown != (self.n, self.postfix):
                self.refresh()
            super().close()

    return ForwardedBar


def progress_bar(total: int, initial: int, desc: str, enabled: bool, stream: TextIO | None = None,
                 forwarded_interval_s: float = 10.0) -> Any:
    """A tqdm bar on ``stream`` (default stdout, as Lightning's); off a terminal, a line per refresh every
    ``forwarded_interval_s``.

    stdout, not tqdm's stderr: the epoch summaries are printed to stdout, and under a launcher the two
    streams are forwarded separately, so a bar on stderr landed before or after its summary by chance.
    """
    from tqdm import tqdm

    stream = stream or sys.stdout
    _ForwardedBar = _forwarded_bar_class()
    if stream.isatty():
        return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, leave=False, file=stream)
    # No bar in a log: "epoch 0: 40/100 steps [00:12<00:18, 3.3it/s, loss=..., step_ms=..., comm=...]", and
    # no empty line at the start (delay): the first line comes with the first refresh, the last at close.
    return _ForwardedBar(total=total, initial=initial, desc=desc, disable=not enabled, file=_LinePerRefresh(stream),
                mininterval=forwarded_interval_s, maxinterval=forwarded_interval_s, delay=1e-6, leave=False,
                bar_format="{desc}: {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}, {rate_fmt}{postfix}]")


def step_postfix(train_loss: float, samples_per_s: float, step_s: float | None,
                 comm_share: float | None) -> dict[str, str]:
    """The bar's numbers, named as the epoch summary names them: the epoch's mean training loss so far,
    the epoch's samples/s and communication share (not running totals since the start), the last step's time."""
    postfix = {"train_loss": f"{train_loss:.4f}"}
    if step_s is not None:
        postfix["step_ms"] = f"{step_s * 1e3:.1f}"
    if comm_share is not None:
        postfix["comm"] = f"{comm_share:.0%}"
    postfix["samples_per_s"] = f"{samples_per_s:.0f}"
    return postfix


def resumed_line(path: str, step: int, epoch: int, batches_done: int, epoch_batches: int, epochs: int,
                 resized_from: int | None = None, world_size: int | None = None) -> str:
    """Rank 0's one line when a run resumes: where in the run the checkpoint put it, 1-based as the bar counts.

    ``epoch`` is the number of finished epochs (the Trainer's count); ``batches_done`` the micro-batches of the
    next one already trained, out of ``epoch_batches``."""
    if batches_done:
        where = f"epoch {epoch + 1} of {epochs}, batch {batches_done} of {epoch_batches}"
    else:
        where = f"epoch {epoch} of {epochs} finished" if epoch else f"the start of epoch 1 of {epochs}"
    resized = f"; saved by {resized_from} ranks, now {world_size}" if resized_from is not None else ""
    return f"lockstep: resumed from step {step} ({where}{resized}) out of {path}"


def nothing_left_line(path: str, step: int, epoch: int, epochs: int, max_steps: int | None) -> str:
    """Rank 0's one line when a resumed run has nothing left to train, and how to train further."""
    if max_steps is not None and step >= max_steps:
        return (f"lockstep: nothing to train: the checkpoint {path} is at step {step}, TrainerConfig.max_steps="
                f"{max_steps}; raise max_steps (or leave it None) to train further")
    return (f"lockstep: nothing to train: the checkpoint {path} finished epoch {epoch} of {epochs}; "
            f"set TrainerConfig.epochs above {epoch} to train further")


def epoch_line(record: dict) -> str:
    """Rank 0's line at each epoch's end, after evaluation: the record's losses and metrics, e.g. "epoch  3  train
    loss 0.2150  eval loss 0.1983  eval accuracy 0.9471  samples/s 6120" (``eval <name>`` for each metric_fn value).
    The bar's last line has the training numbers only, and on a terminal it is cleared when the epoch ends."""
    parts = [f"epoch {record['epoch']:>2}", f"train loss {record['train_loss']:.4f}"]
    shown = [key for key in ("eval_loss", "eval_accuracy") if key in record]  # first, then metric_fn's
    shown += [key for key in record if key.startswith("eval_") and key not in [*shown, "eval_samples"]]
    parts += [f"eval {key.removeprefix('eval_')} {record[key]:.4f}" for key in shown]
    parts.append(f"samples/s {record['samples_per_s']:.0f}")
    return "  ".join(parts)
