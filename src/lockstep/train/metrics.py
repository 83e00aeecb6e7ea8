"""What the Trainer reports: JSON-lines metrics from rank 0, and how much of a step is spent communicating.

Two ways to get the communication share. If the DDP wrapper keeps its own account
(``ddp.comm_stats()`` -> ``{"comm_wait_s", "steps"}``: time the end of backward spent
waiting for all-reduces), the share is that wait over the measured step time. Otherwise
``measure_exposed_comm`` times the same micro-batch's forward+backward with and without
gradient synchronisation (``no_sync``) and reports the difference: the communication
that computation did not hide. It costs a few extra steps' worth of compute at the end.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


class MetricsLog:
    """Appends one JSON object per line; a no-op on every rank but the writer.

    Appending (not truncating) keeps the lines of an interrupted run when it resumes, and of
    earlier runs; each record carries its ``step`` so a reader can tell repeats apart, and its
    ``run`` (``run_id``, set by the Trainer) so ``select_run`` can keep one run's lines.
    """

    def __init__(self, path: str | os.PathLike | None, enabled: bool):
        self.path = Path(path) if path is not None else None
        self.run_id: str | None = None
        self.sinks: list = []  # per-run CSV / TensorBoard loggers (loggers.py), handed each record
        self._file = None
        if enabled and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            if self.run_id is not None:
                record = {**record, "run": self.run_id}
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()  # a crash loses at most the line being written
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every record in the file, all runs; ``select_run`` keeps one run's."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def select_run(records: list[dict], run: str | None = None) -> list[dict]:
    """The records of run ``run`` (default: the run of the last record that names one), in file order.

    A resumed run keeps its run id, so its lines before and after the interruption stay together;
    a file with no run ids at all (written before them) is returned whole.
    """
    if run is None:
        run = next((r["run"] for r in reversed(records) if r.get("run")), None)
        if run is None:
            return list(records)
    return [r for r in records if r.get("run") == run]


def measure_exposed_comm(
    ddp: torch.nn.parallel.DistributedDataParallel, run_micro_batch: Callable[[], torch.Tensor], reps: int = 5
) -> dict:
    """Time forward+backward of one micro-batch synced and under ``no_sync``; return the exposed share.

    Every rank must call this the same number of times (the synced backward is a
    collective). Gradients are zeroed afterwards; the optimizer is never stepped, so the
    parameters are unchanged.
    """
    synced, local = [], []
    for _ in range(reps + 1):  # the first pair warms up allocators and is discarded
        t0 = time.perf_counter()
        with ddp.no_sync():
            run_micro_batch().backward()
        t1 = time.perf_counter()
        run_micro_batch().backward()
        t2 = time.perf_counter()
        local.append(t1 - t0)
        synced.append(t2 - t1)
    ddp.zero_grad(set_to_none=True)
    synced_s, local_s = statistics.median(synced[1:]), statistics.median(local[1:])
    exposed_s = max(0.0, synced_s - local_s)
    return {
        "method": f"synced minus no_sync forward+backward, median of {reps}",
        "synced_step_s": synced_s,
        "local_step_s": local_s,
        "comm_share": exposed_s / synced_s if synced_s > 0 else 0.0,
    }


def comm_wait_share(ddp: torch.nn.Module, step_time_s: float) -> float | None:
    """The DDP's cumulative all-reduce wait over ``step_time_s``; None if it keeps no account. Free: no collective."""
    stats = getattr(ddp, "comm_stats", None)
    if not callable(stats) or step_time_s <= 0:
        return None
    return min(1.0, float(stats()["comm_wait_s"]) / step_time_s)


def comm_report(trainer) -> dict:
    """Share of the Trainer's step time spent in communication.

    With ``ddp.comm_stats()`` (lockstep's DDP): the all-reduce wait at the end of backward
    over the measured step time, for the steps this process ran. Otherwise (torch's DDP):
    ``measure_exposed_comm`` on one training micro-batch. A collective either way: call it
    on every rank.
    """
    share = comm_wait_share(trainer.ddp, trainer._train_time_s)
    if share is not None:
        return {"method": "all-reduce wait not hidden by backward, from ddp.comm_stats()",
                "comm_wait_s": float(trainer.ddp.comm_stats()["comm_wait_s"]), "step_time_s": trainer._train_time_s,
                "comm_share": share}
    from lockstep.sampler import DistributedSampler

    # a fresh sampler: iterating the training one would disturb its saved position
    sampler = DistributedSampler(trainer.train_data, trainer.world_size, trainer.rank, seed=trainer.config.seed)
    inputs, targets = next(iter(trainer._loader(trainer.train_data, sampler, trainer.config.batch_size, 0)))
    inputs, targets = inputs.to(trainer.device), targets.to(trainer.device)
    return measure_exposed_comm(trainer.ddp, lambda: trainer.loss_fn(trainer.ddp(inputs), targets))
