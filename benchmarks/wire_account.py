"""Where the wire idled during one step: node 0's NIC counter sampled while the step runs, against its phases.

``benchmarks/link.py --trace`` uses it (issue #35: "the traces' account of where the wire idled"). A thread on
rank 0 reads its veth's ``tx_bytes`` (``/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics/tx_bytes``) every
``SAMPLE_S`` while one step runs; the step's phases (forward, backward, optimizer step) are timed on the
training thread. The wire counts as idle over a sample interval in which node 0 sent less than ``IDLE_SHARE``
of what the shaped rate could carry in it (a barrier's or a heartbeat's bytes are a few hundred). This is the
kernel's own count of what left the node, so it needs no instrumentation of any DDP: torch's, lockstep's and
compute-then-send are measured alike.

Cost: the thread wakes every ``SAMPLE_S`` (a sysfs read, a few microseconds) and takes the GIL for it, on
the traced step only, never on the timed ones. Its resolution is the sample interval plus the interpreter's
switch interval (5 ms) where the training thread runs Python: gaps shorter than ~5 ms are not told apart.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

SAMPLE_S = 0.0005
IDLE_SHARE = 0.05  # an interval that carried < 5% of what the rate allows counts as idle


class WireSampler:
    """Samples ``counter`` (a ``tx_bytes`` file) on a thread between ``start()`` and ``stop()``."""

    def __init__(self, counter: Path, sample_s: float = SAMPLE_S) -> None:
        self.counter = counter
        self.sample_s = sample_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wire-sampler", daemon=True)

    def _run(self) -> None:
        read = self.counter.read_text
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), int(read())))
            time.sleep(self.sample_s)

    def start(self) -> WireSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), int(self.counter.read_text())))
        return self.samples


def idle_intervals(samples: list[tuple[float, int]], rate_bits: float, start: float, end: float
                   ) -> list[tuple[float, float]]:
    """The intervals of ``[start, end]`` (seconds) in which the counter grew less than ``IDLE_SHARE`` of the rate
    (merged where they touch)."""
    idle: list[tuple[float, float]] = []
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        lo, hi = max(t0, start), min(t1, end)
        if hi <= lo or (b1 - b0) * 8 >= IDLE_SHARE * rate_bits * (t1 - t0):
            continue
        if idle and lo - idle[-1][1] < 1e-9:
            idle[-1] = (idle[-1][0], hi)
        else:
            idle.append((lo, hi))
    return idle


def account(samples: list[tuple[float, int]], rate_bits: float, phases: list[tuple[str, float, float]]) -> dict:
    """The step (first phase's start to last phase's end) and the wire's idle time in it, in ms, in all and per
    phase (a phase's name may repeat: summed), with the idle stretches longer than 5 ms listed."""
    start, end = phases[0][1], phases[-1][2]
    idle = idle_intervals(samples, rate_bits, start, end)
    per_phase: dict[str, float] = {}
    for name, lo, hi in phases:
        overlap = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in idle)
        per_phase[name] = per_phase.get(name, 0.0) + overlap * 1e3
    sent = samples[-1][1] - samples[0][1] if samples else 0
    return {"step_ms": (end - start) * 1e3, "idle_ms": sum(b - a for a, b in idle) * 1e3,
            "idle_by_phase_ms": per_phase, "sent_bytes": sent,
            "stretches_ms": [((a - start) * 1e3, (b - a) * 1e3) for a, b in idle if b - a > 0.005]}


def markdown(accounts: dict[str, dict]) -> list[str]:
    """A table, one row per contender: step, idle, idle per phase, and the long idle stretches (start+length)."""
    lines = ["| contender (traced step) | step ms | wire idle ms | idle in forward / backward / optimizer step | "
             "idle stretches > 5 ms (from the step's start: at ms, for ms) |", "|---|---|---|---|---|"]
    for name, acc in accounts.items():
        by = acc["idle_by_phase_ms"]
        phases = " / ".join(f"{by.get(p, 0.0):.0f}" for p in ("forward", "backward", "optimizer step"))
        other = {p: v for p, v in by.items() if p not in ("forward", "backward", "optimizer step") and v >= 0.5}
        phases += "".join(f"; {p} {v:.0f}" for p, v in other.items())
        stretches = ", ".join(f"{at:.0f}+{length:.0f}" for at, length in acc["stretches_ms"]) or "-"
        lines.append(f"| {name} | {acc['step_ms']:.1f} | {acc['idle_ms']:.1f} | {phases} | {stretches} |")
    return lines
