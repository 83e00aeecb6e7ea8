"""What keeps a process that trained with lockstep exiting 0 (``collectives/clean.py``, ``ddp/lifetime.py``).

A work launched inside backward must not capture a Python object in torch's thread-local state: gloo's
thread may free it after the interpreter started finalising, and then the process aborts. lockstep
removes the one object torch's backward stashes there around every launch. These tests hold that in
place on the installed torch (the exit loops in ``test_exits.py`` are the end-to-end check).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from lockstep.collectives import clean
from lockstep.ddp.lifetime import bury


def _stashed() -> set[str]:
    """The keys under which torch's backward (``_engine_run_backward``) stashes Python objects in TLS."""
    return set(re.findall(r"_stash_obj_in_tls\(\s*[\"'](\w+)[\"']", inspect.getsource(torch.autograd.graph)))


def test_every_object_torchs_backward_stashes_is_one_launch_clean_removes():
    stashed = _stashed()
    # torch < 2.13 stashes nothing; a new key here means a new Python object in every work: handle it in clean.py.
    assert stashed <= {clean._TLS_KEY}, f"torch's backward now stashes {sorted(stashed)} in thread-local state"
    if stashed:
        assert clean._remove_obj_from_tls is not None


def test_a_launch_inside_backward_sees_no_stashed_object_and_backward_gets_it_back():
    seen = {}
    w = torch.nn.Parameter(torch.randn(3))

    def launch(tag):
        seen["during_launch"] = torch._C._is_key_in_tls(clean._TLS_KEY)
        return tag

    def hook(param):
        seen["in_backward"] = torch._C._is_key_in_tls(clean._TLS_KEY)
        before = torch._C._get_obj_in_tls(clean._TLS_KEY) if seen["in_backward"] else None
        seen["returned"] = clean.launch_clean(launch, "work")
        seen["restored"] = (not seen["in_backward"]) or torch._C._get_obj_in_tls(clean._TLS_KEY) is before

    w.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    assert seen["in_backward"] == bool(_stashed())  # torch >= 2.13 stashes its context for the length of a backward
    assert seen["during_launch"] is False
    assert seen["returned"] == "work" and seen["restored"]


def test_a_failed_launch_puts_the_object_back():
    w = torch.nn.Parameter(torch.randn(3))
    seen = {}

    def launch():
        raise RuntimeError("gloo said no")

    def hook(param):
        with pytest.raises(RuntimeError, match="gloo said no"):
            clean.launch_clean(launch)
        seen["after"] = torch._C._is_key_in_tls(clean._TLS_KEY)

    w.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    assert seen["after"] == bool(_stashed())


def test_the_graveyard_lets_go_only_of_works_older_than_the_safe_age():
    import collections

    graveyard = collections.deque()
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    bury(["a", None, "b"], graveyard, clock, safe_after_s=5.0)
    now[0] = 103.0
    bury(["c"], graveyard, clock, safe_after_s=5.0)
    assert [works for _, works in graveyard] == [["a", "b"], ["c"]]  # None is not kept
    now[0] = 105.5
    bury([], graveyard, clock, safe_after_s=5.0)  # nothing new: still prunes
    assert [works for _, works in graveyard] == [["c"]]


def test_the_graveyard_keeps_a_work_still_in_flight_however_old():
    import collections
    import types

    graveyard = collections.deque()
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731
    in_flight = types.SimpleNamespace(is_completed=lambda: False)
    bury([in_flight], graveyard, clock, safe_after_s=5.0)
    bury(["later"], graveyard, clock, safe_after_s=5.0)
    now[0] = 200.0
    bury([], graveyard, clock, safe_after_s=5.0)
    assert [works for _, works in graveyard] == [[in_flight], ["later"]]  # and what came after it, in order
    in_flight.is_completed = lambda: True
    bury([], graveyard, clock, safe_after_s=5.0)
    assert not graveyard


def _raise_in_forward_under_join_then_exit(rank: int, port: int) -> None:
    """A rank of torch's ``test_ddp_uneven_input_exception``, as its harness runs it: the forward raises inside
    ``join()``, the group is destroyed, and the process exits while the traceback still holds the DDP object."""
    import os
    import sys

    import torch.distributed as dist

    import lockstep

    class Raises(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.param = torch.nn.Parameter(torch.ones(1))

        def forward(self, _):
            raise ValueError("intentional")

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = lockstep.DistributedDataParallel(Raises())
    try:
        with model.join():
            model(torch.ones(1)).sum().backward()
    except ValueError:
        pass
    else:
        os._exit(3)
    dist.destroy_process_group()
    sys.exit(0)  # multiprocessing's _bootstrap frees the traceback (and the DDP object, and its group) here


def test_a_forward_that_raises_under_join_exits_0():
    # torch 2.4 (the smoke set): the join's all-reduces were dropped in flight, and the group's destructor, run with
    # the GIL held, waited for gloo's worker, which waited for the GIL to free their tensors: a hang in 1 run of 2.
    import multiprocessing

    from lockstep.process_group import free_port

    ctx = multiprocessing.get_context("fork")
    for attempt in range(6):
        port = free_port()
        ranks = [ctx.Process(target=_raise_in_forward_under_join_then_exit, args=(r, port)) for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(30)
        hung = [r for r, p in enumerate(ranks) if p.exitcode is None]
        for r in hung:
            ranks[r].kill()
        assert not hung, f"attempt {attempt}: rank(s) {hung} still running 30 s after the forward raised"
        assert [p.exitcode for p in ranks] == [0, 0], f"attempt {attempt}"


def test_a_dropped_reducer_hands_its_works_to_the_graveyard():
    # Reducer.__del__ runs where no exception can surface (an "Exception ignored" line at most), so a broken
    # one goes unseen while the works it should keep are freed wherever the last reference drops.
    import types

    from lockstep.ddp import lifetime
    from lockstep.ddp.reducer import Reducer

    work, status_work = object(), object()  # stand for dist.Work objects
    fake = types.SimpleNamespace(buckets=[types.SimpleNamespace(work=work)], usage=types.SimpleNamespace(last_work=status_work))
    Reducer.__del__(fake)
    kept = [w for _, works in lifetime._GRAVEYARD for w in works]
    assert work in kept and status_work in kept
    assert fake.buckets[0].work is work  # not unset: finalisation may still be reading the reducer
    Reducer.release_works(fake, keep=False)  # a new backward's start: dropped and unset
    assert fake.buckets[0].work is None and fake.usage.last_work is None


def test_settling_waits_for_runnable_gloo_workers_then_two_quiet_polls():
    from lockstep.ddp.lifetime import settle_gloo_workers

    polls = iter([{7: "R", 8: "S"}, {7: "R", 8: "S"}, {7: "S", 8: "S"}, {7: "S", 8: "S"}, {7: "R"}])
    events = []
    now = [0.0]

    def sleep(s):
        events.append("sleep")
        now[0] += s

    def states():
        events.append("poll")
        return next(polls)

    assert settle_gloo_workers(timeout_s=1.0, poll_s=0.01, states=states, clock=lambda: now[0], sleep=sleep)
    assert events == ["poll", "sleep"] * 3 + ["poll"]  # quiet twice in a row, a sleep between: settled
    # never quiet: gives up at the timeout instead of holding the exit
    now[0], events[:] = 0.0, []
    assert not settle_gloo_workers(timeout_s=0.05, poll_s=0.01, states=lambda: {7: "R"}, clock=lambda: now[0], sleep=sleep)
    assert 4 <= events.count("sleep") <= 6
    # no named worker (no /proc, torch 2.4, no gloo group): returns at once
    assert settle_gloo_workers(states=dict, sleep=sleep, clock=lambda: now[0]) and events.count("sleep") <= 6


def test_settling_returns_only_once_gloo_has_let_go_of_a_running_collective(tmp_path):
    import torch.distributed as dist

    from lockstep.ddp.lifetime import gloo_worker_states, settle_gloo_workers

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        if not gloo_worker_states():
            pytest.skip(f"torch {torch.__version__} does not name gloo's worker threads")
        big = torch.ones(2**25)  # 128 MB: gloo's worker copies it for ~0.1 s
        out = [torch.empty_like(big)]
        seen = []

        def states():
            seen.append(gloo_worker_states())
            return seen[-1]

        work = dist.all_gather(out, big, async_op=True)
        assert settle_gloo_workers(timeout_s=10.0, states=states)
        assert any("R" in s.values() for s in seen)  # it saw the worker at work, and waited
        assert work.is_completed() and torch.equal(out[0][:5], big[:5])
        assert all(v != "R" for v in seen[-1].values())
    finally:
        dist.destroy_process_group()
