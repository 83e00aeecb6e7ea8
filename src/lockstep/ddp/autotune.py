"""``bucket_cap_mb="auto"``: try a few bucket caps over the first steps, keep the fastest.

torch's 25 MB cap is a guess (PyTorch #118421 asks for tuning); the best cap depends on
the link (a gloo all-reduce here: 1.0 GB/s at 1 MB, 1.8 GB/s at 100 MB) and on the model.
So after the first synchronised backward (and the usual rebuild from the observed
order), each candidate layout runs for ``warmup_steps + timed_steps`` steps; a step is
the time from one synchronised forward to the next, optimizer and data loading included.
Rank 0's medians decide: they are broadcast (one collective of ``len(caps_mb)`` values,
once) and every rank takes the argmin of the same numbers, so every rank builds the same
buckets. The layout never changes results at 2 ranks (each element is a/2 + b/2, whatever
bucket it sits in); at more ranks gloo's ring may sum an element in another order, a
last-bit difference, as between any two caps.

Every rank switches layouts at the same round (a completed synchronised backward, or a
joined rank's shadow of one), so a rebuild is never half-way across ranks. A hook that is
not known to issue its collectives up front may keep state per bucket (torch's PowerSGD
does): with one registered before the first backward, nothing is tried and the cap stays
25 MB.

The default (``bucket_cap_mb`` and ``bucket_cap_mb_list`` left unset) starts these trials by itself where
the wire is slow: a link between nodes, where one 25 MB bucket holds a small model and nothing overlaps its
backward. ``tail_wants_trials`` judges, on each rank, the synchronised backward after the rebuild (the first
one pays for gloo's buffers of these sizes): at its end, the bytes still to cross (buckets not launched or not
complete) took ``waited_s`` to come back (from the backward's end to its last average, a slow wire's
one-at-a-time launches included); a rate under ``LINK_BELOW_BYTES_S`` (loopback's gloo moves 1-1.8
GB/s, a 2.5 Gbit/s link 0.25-0.3) with that tail at least ``TAIL_FRACTION`` of the backward means buckets sent
during backward could hide it. A rank that waited for a slower peer reads a slower wire than there is; the
last rank to arrive waited for the wire alone. So the ranks agree at that backward's end, after its other
collectives, with one all-reduce of one number, once per run (``all_say_slow``; a joined rank's shadow votes
"not slow"): the trials start on every rank at the next round, only where every rank judged the wire slow. A
loaded machine's loopback can pass for a slow wire; the worst a wrong verdict costs is the trials' steps, since
they keep the measured best.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.ddp.buckets import MIB

log = logging.getLogger("lockstep.ddp.autotune")

ONE_BUCKET_BYTES = 1 << 62  # "one bucket": a cap nothing reaches (one bucket per device and dtype)
# The default's link verdict (``tail_wants_trials``): a tail rate below 0.6 GB/s (between a 2.5 Gbit/s link's
# 0.25-0.3 and loopback's 1-1.8), a tail of at least 10% of the backward and 2 ms, at least 1 MiB left to cross.
LINK_BELOW_BYTES_S = 0.6e9
TAIL_FRACTION = 0.1
TAIL_MIN_S = 2e-3
TAIL_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class AutoBucketCap:
    """What ``bucket_cap_mb="auto"`` tries; pass an instance as ``bucket_cap_mb`` to change it."""

    caps_mb: tuple[float | None, ...] = (1.0, 4.0, 25.0, 100.0, None)
    """Candidate caps in MiB, tried in this order; ``None`` is one bucket for all gradients."""
    warmup_steps: int = 1
    """Untimed steps after each switch (fresh buffers, first touches)."""
    timed_steps: int = 3
    """Timed steps per candidate; their median is the candidate's time."""

    def __post_init__(self) -> None:
        caps = tuple(self.caps_mb)
        if not caps or any(c is not None and not (isinstance(c, (int, float)) and c > 0) for c in caps):
            raise ValueError(
                f"AutoBucketCap.caps_mb must be a non-empty sequence of caps > 0 or None, got {self.caps_mb!r}"
            )
        object.__setattr__(self, "caps_mb", caps)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"AutoBucketCap.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.timed_steps, int) or self.timed_steps < 1:
            raise ValueError(f"AutoBucketCap.timed_steps must be an int >= 1, got {self.timed_steps!r}")

    @property
    def trial_steps(self) -> int:
        """Steps the trials take, after the first one: the run then keeps the chosen layout."""
        return len(self.caps_mb) * (self.warmup_steps + self.timed_steps)


def caps_bytes(cap_mb: float | None, first_bucket_bytes: int) -> list[int]:
    """The per-bucket caps (``assign_buckets``'s ``bucket_caps_bytes``) of one candidate."""
    if cap_mb is None:
        return [ONE_BUCKET_BYTES]
    cap = max(1, int(cap_mb * MIB))
    return [min(first_bucket_bytes, cap), cap]


@dataclass
class LinkVerdict:
    """The default caps' verdict on the wire (one per reducer): judged once, on the backward after the rebuild."""

    pending: bool  # the default caps, several ranks, and no verdict yet
    tail_bytes: int = 0  # the judged backward's bytes still to cross at its end
    tail_s: float = 0.0  # ... and the seconds from the backward's end to their last average back
    vote: bool = False  # this rank's ``tail_wants_trials``


def tail_wants_trials(pending_bytes: int, waited_s: float, backward_s: float) -> bool:
    """The judged backward's end: ``pending_bytes`` still to cross (not launched or not complete) came back in
    ``waited_s``, after a backward of ``backward_s``: a slow wire whose tail buckets sent earlier could hide."""
    if pending_bytes < TAIL_MIN_BYTES or waited_s < max(TAIL_MIN_S, TAIL_FRACTION * backward_s):
        return False
    return pending_bytes < LINK_BELOW_BYTES_S * waited_s


def all_say_slow(vote: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Every rank's ``tail_wants_trials`` verdict, agreed: True only where all said slow (one all-reduce, MIN)."""
    vote_t = torch.tensor([int(vote)], dtype=torch.int64, device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(vote_t, op=dist.ReduceOp.MIN, group=group)
    return bool(vote_t.item())


def trials_for_slow_wire(tail_bytes: int, tail_s: float, rank: int) -> BucketTuner:
    """The default's trials, started where every rank's verdict said slow (``all_say_slow``); rank 0 says why in the
    log, with its own tail."""
    tuner = BucketTuner(AutoBucketCap())
    if rank == 0:
        log.info("a backward's last %.1f MB took %.0f ms to cross after it on every rank: trying bucket caps "
                 "(bucket_cap_mb='auto') over the next %d steps; a fixed bucket_cap_mb keeps its cap",
                 tail_bytes / 1e6, tail_s * 1e3, tuner.config.trial_steps)
    return tuner


class TunedReducer(Protocol):
    """What the tuner reads and calls on the reducer it tunes."""

    rounds: int  # synchronised backwards completed, a joined rank's shadows included
    comm_hook: Any
    process_group: dist.ProcessGroup
    first_bucket_bytes: int

    @property
    def buckets(self) -> Sequence[Any]: ...

    def relayout(self, bucket_caps_bytes: list[int]) -> None: ...


class BucketTuner:
    """Drives the trials for one reducer: called between steps, it switches layouts and finally decides."""

    def __init__(self, config: AutoBucketCap, drain: Callable[[], None] | None = None):
        self.config = config
        self.drain = drain  # None: wait for the buckets' GPU (``_drain``); tests pass their own
        self.step_s: list[list[float]] = [[] for _ in config.caps_mb]
        self.candidate = -1  # index into caps_mb of the layout in use; -1: the initial (fixed 25 MB) layout
        self.rounds_at_switch = 0
        self._last_mark: tuple[int, float] | None = None  # (rounds, perf_counter) at the last step boundary
        self.result: dict | None = None  # after the decision: caps, medians, choice
        self.done = False

    def between_steps(self, reducer: TunedReducer, hook_known: bool) -> None:
        """At a synchronised forward (or a joined rank's round): time the last step, switch or decide."""
        rounds = reducer.rounds
        self._drain(reducer)
        now = time.perf_counter()
        mark, self._last_mark = self._last_mark, (rounds, now)
        if rounds == 0:
            return
        if self.candidate < 0:
            if reducer.comm_hook is not None and not hook_known:
                self.done = True  # a hook that may keep state per bucket: keep the layout it started with
                self.result = {"skipped": "comm hook not known to issue its collectives up front"}
                return
            self._switch(reducer, 0, rounds)
            return
        cfg = self.config
        into_trial = rounds - self.rounds_at_switch  # steps completed under this candidate
        if mark is not None and mark[0] == rounds - 1 and into_trial > cfg.warmup_steps:
            self.step_s[self.candidate].append(now - mark[1])
        if into_trial < cfg.warmup_steps + cfg.timed_steps:
            return
        if self.candidate + 1 < len(cfg.caps_mb):
            self._switch(reducer, self.candidate + 1, rounds)
        else:
            self._decide(reducer)

    def _drain(self, reducer: TunedReducer) -> None:
        """Wait for the device to finish the step, during the trials only.

        On a GPU the host runs ahead: between two forwards it has only launched the step's kernels,
        so a step timed on the host alone measures launches, not the step, and would favour whichever
        layout launches least. Each trial step boundary therefore waits for the buckets' device (one
        host sync per trial step, ~20 in all; none once the cap is chosen), and every candidate is timed
        the same way. On CPU the step is done when the forward starts: nothing to wait for.
        """
        if self.drain is not None:
            self.drain()
            return
        device = reducer.buckets[0].buffer.device if reducer.buckets else None
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    def _switch(self, reducer: TunedReducer, candidate: int, rounds: int) -> None:
        self.candidate, self.rounds_at_switch = candidate, rounds
        reducer.relayout(caps_bytes(self.config.caps_mb[candidate], reducer.first_bucket_bytes))

    def _decide(self, reducer: TunedReducer) -> None:
        # Rank 0's medians for every rank (inf where a rank joined early and timed nothing): one broadcast, once.
        medians = [statistics.median(t) if t else math.inf for t in self.step_s]
        group = reducer.process_group
        device = reducer.buckets[0].buffer.device if dist.get_backend(group) == "nccl" else "cpu"
        medians_t = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.broadcast(medians_t, src=dist.get_global_rank(group, 0), group=group)
        medians = medians_t.tolist()
        best = min(range(len(medians)), key=medians.__getitem__)
        chosen = self.config.caps_mb[best]
        reducer.relayout(caps_bytes(chosen, reducer.first_bucket_bytes))
        self.done = True
        self.result = {"caps_mb": list(self.config.caps_mb), "median_step_s": medians, "chosen_mb": chosen,
                       "num_buckets": len(reducer.buckets)}
        if dist.get_rank(group) == 0:
            shown = ", ".join(f"{_label(c)} {m * 1e3:.1f} ms" for c, m in zip(self.config.caps_mb, medians))
            log.info("bucket_cap_mb='auto' chose %s (%d buckets); median step time per cap (rank 0): %s",
                     _label(chosen), len(reducer.buckets), shown)


def _label(cap_mb: float | None) -> str:
    return "one bucket" if cap_mb is None else f"{cap_mb:g} MB"

