"""One epoch's account on one rank: time, samples, and where the time went (data, compute, communication).

The progress bar, the epoch's metrics record and the straggler line all read the same meter, so
the numbers they show agree: ``samples_per_s`` and ``comm`` are this epoch's, not running totals
since the start (a resumed or slowed-down epoch shows as itself). The meter is replaced whole at
each epoch's start (STYLE habit 10); nothing in it is checkpointed, so an epoch resumed midway
accounts only for the part this process ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EpochMeter:
    """This rank's timing for the epoch under way. Times are wall-clock seconds of optimizer steps only
    (logging, checkpoints and evaluation are left out)."""

    comm_wait_at_start_s: float = 0.0  # the DDP's cumulative all-reduce wait when the epoch began
    comm_wait_s: float = 0.0  # all-reduce wait at the end of backward this epoch (rank-local)
    step_s: float = 0.0  # whole optimizer steps: data + compute + communication + optimizer
    data_s: float = 0.0  # waiting for the DataLoader's next batch
    steps: int = 0  # optimizer steps this epoch, on this process
    samples: int = 0  # samples of every rank in those steps (equal shards: this rank's x world size)
    last_step_s: float | None = None  # the latest step's time (the bar's step_ms)
    step_comm_s: list[float] = field(default_factory=list)  # each step's all-reduce wait: the straggler's noise

    def add_step(self, step_s: float, samples: int) -> None:
        self.last_step_s = step_s
        self.step_s += step_s
        self.samples += samples
        self.steps += 1

    def update_comm(self, comm_wait_total_s: float | None) -> None:
        """Take the DDP's cumulative wait (``ddp.comm_stats()``; None: it keeps none) as of now. Free."""
        if comm_wait_total_s is not None:
            wait_s = comm_wait_total_s - self.comm_wait_at_start_s
            if len(self.step_comm_s) < self.steps:  # the first reading since a step ended: that step's own wait
                self.step_comm_s.append(wait_s - self.comm_wait_s)
            self.comm_wait_s = wait_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s > 0 else 0.0

    @property
    def comm_share(self) -> float:
        return min(1.0, self.comm_wait_s / self.step_s) if self.step_s > 0 else 0.0

    @property
    def compute_s(self) -> float:
        """Everything in the steps that was neither data loading nor the all-reduce wait (forward, backward,
        optimizer)."""
        return max(0.0, self.step_s - self.data_s - self.comm_wait_s)

    def phases(self) -> dict[str, float]:
        """What the straggler line gathers from every rank (a few floats, once per epoch)."""
        return {"data_s": self.data_s, "compute_s": self.compute_s, "comm_s": self.comm_wait_s,
                "step_s": self.step_s, "steps": float(self.steps)}

    def comm_blocks(self, n_blocks: int) -> list[float]:
        """The mean all-reduce wait per step in ``n_blocks`` consecutive runs of this epoch's steps (one step each
        when there are fewer steps; NaN fills the rest): every rank steps alike, so block b covers the same steps
        on every rank, and the blocks' differences between ranks measure the wait's noise (stragglers.py)."""
        waits, blocks = self.step_comm_s, []
        n = min(n_blocks, len(waits))
        for b in range(n):
            chunk = waits[b * len(waits) // n:(b + 1) * len(waits) // n]
            blocks.append(sum(chunk) / len(chunk))
        return blocks + [float("nan")] * (n_blocks - n)
