"""The observer seam: events arrive in a step's order, once each, with the launch sequence numbers."""

from __future__ import annotations

import torch

from dist_utils import run_ranks
from lockstep import DistributedDataParallel as DDP
from lockstep.ddp.observe import StepObserver, attach, detach


class Recorder(StepObserver):
    def __init__(self):
        self.log: list[tuple] = []

    def __getattribute__(self, name):
        if name in ("log", "__class__", "__dict__"):
            return object.__getattribute__(self, name)
        if name == "waiting":  # the buckets themselves hold works (not picklable): their indices
            return lambda buckets, op: self.log.append((name, [b.index for b in buckets], op))
        if name in StepObserver.__dict__ and not name.startswith("_") and callable(StepObserver.__dict__[name]):
            return lambda *args: self.log.append((name, *args))
        return object.__getattribute__(self, name)


def _events(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = DDP(model, bucket_cap_mb_list=[0.0001, 0.0004])  # several buckets
    rec, other = Recorder(), Recorder()
    ddp.reducer.observer = attach(attach(None, rec), other)
    for _ in range(2):
        ddp(torch.randn(4, 8)).sum().backward()
    ddp.reducer.observer = detach(ddp.reducer.observer, other)
    ddp(torch.randn(4, 8)).sum().backward()
    return [rec.log, other.log, len(ddp.reducer.buckets)]


def test_events_in_step_order():
    results = run_ranks(_events, 2)
    assert results[0][0] == results[1][0]  # the same events and sequence numbers on every rank
    log, other, nbuckets = results[0]
    assert nbuckets > 1 and len(other) * 3 == len(log) * 2  # the detached one saw two steps of three
    steps = []
    for entry in log:
        if entry[0] == "forward_start":
            steps.append([])
        steps[-1].append(entry)
    assert len(steps) == 3
    seq = 0
    for i, step in enumerate(steps):
        names = [e[0] for e in step]
        assert names[:3] == ["forward_start", "forward_end", "backward_start"] and names[-1] == "backward_end"
        assert step[-1][1] == i + 1
        # the end of backward says once what it waits for (the hang watchdog's progress reads which from the works)
        assert [e for e in step if e[0] == "waiting"] == [("waiting", list(range(nbuckets)), "all-reduce")]
        assert names.index("waiting") < names.index("wait_start")
        launches = [e for e in step if e[0] == "bucket_launch"]
        assert len(launches) == nbuckets and sorted(e[1] for e in launches) == list(range(nbuckets))
        for e in launches:
            seq += 1
            assert e[3] == seq  # one sequence number per launch, counting on across steps
        for b in range(nbuckets):
            where = {n: names.index(n, 0) for n in names}
            ready = [k for k, e in enumerate(step) if e[:2] == ("bucket_ready", b)]
            launch = [k for k, e in enumerate(step) if e[:2] == ("bucket_launch", b)]
            wait = [k for k, e in enumerate(step) if e[:2] == ("wait_start", b)]
            done = [k for k, e in enumerate(step) if e[:2] == ("wait_end", b)]
            assert len(ready) == len(launch) == len(wait) == len(done) == 1, (b, names)
            assert ready[0] < launch[0] < wait[0] < done[0] < where["backward_end"]
