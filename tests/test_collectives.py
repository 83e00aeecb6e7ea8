"""Ring and tree all-reduce against gloo's own, on 2, 3 and 4 real ranks; the ring's halves alone
(``ring_reduce_scatter``, ``ring_all_gather``) and queued (``RingQueue``, ZeRO-2's pair on gloo).

One spawned group per world size runs every case (sizes, dtypes, segmentations,
sub-groups, bad input) and returns compact results; the test functions assert on
them. The reference for floats is the exact float64 sum of every rank's input
(each rank regenerates all inputs from their seeds), so a result is checked
against arithmetic, not only against another implementation.
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from levels import full_only
from lockstep.collectives import (
    Peers,
    all_reduce,
    chunk_bounds,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tree_all_reduce,
)
from lockstep.collectives.ring import pick_segment_numel, receive_scratch
from lockstep.collectives.ring_queue import RingQueue

SIZES = [0, 1, 2, 3, 7, 1001, 70_000]
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32]
ALGOS = ["ring", "tree"]


def _input(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + numel + 7 * salt)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-1_000_000, 1_000_000, (numel,), generator=g, dtype=dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _check(t, rank, world_size, numel, dtype, native, salt=0):
    """(max error vs the exact float64 sum, max |x - native|, tolerance, digest)."""
    exact = sum(_input(r, numel, dtype, salt).double() for r in range(world_size))
    if numel == 0:
        return (0.0, 0.0, 0.0, _digest(t))
    err = (t.double().view(-1) - exact).abs().max().item()
    vs_native = (t.double() - native.double()).abs().max().item()
    if dtype.is_floating_point:
        # Each partial sum rounds once: at most (N-1) roundings of |sum of |x||.
        magnitude = sum(_input(r, numel, dtype, salt).double().abs() for r in range(world_size)).max().item()
        tol = (world_size - 1) * torch.finfo(dtype).eps * magnitude
    else:
        tol = 0.0
    return (err, vs_native, tol, _digest(t))


def _cases(rank: int, world_size: int):
    out = {}
    for algo in ALGOS:
        for dtype in DTYPES:
            for numel in SIZES:
                x = _input(rank, numel, dtype)
                native = x.clone()
                dist.all_reduce(native)
                returned = all_reduce(x, algorithm=algo)
                assert returned is x, "all_reduce must work in place and return its argument"
                out[(algo, str(dtype), numel)] = _check(x, rank, world_size, numel, dtype, native)
        # A 2-D tensor keeps its shape; tiny segments force many tagged messages per chunk.
        x = _input(rank, 1001, torch.float32, salt=1).view(7, 143)
        native = x.clone()
        dist.all_reduce(native)
        all_reduce(x, algorithm=algo)
        out[(algo, "2d", 1001)] = _check(x.view(-1), rank, world_size, 1001, torch.float32, native.view(-1), salt=1)
        x = _input(rank, 1001, torch.float32, salt=2)
        native = x.clone()
        dist.all_reduce(native)
        fn = ring_all_reduce if algo == "ring" else tree_all_reduce
        fn(x, Peers.of(), segment_nbytes=40)
        out[(algo, "segmented", 1001)] = _check(x, rank, world_size, 1001, torch.float32, native, salt=2)
    # Chunks between one and two segments long go as one message each (pick_segment_numel);
    # the receive pool is then a chunk, carved from the scratch buffer the cases above grew.
    x = _input(rank, 1001, torch.float32, salt=4)
    native = x.clone()
    dist.all_reduce(native)
    chunk_numel = chunk_bounds(1001, world_size)[0][1]
    ring_all_reduce(x, Peers.of(), segment_nbytes=4 * (chunk_numel * 2 // 3))
    out[("ring", "whole-chunk", 1001)] = _check(x, rank, world_size, 1001, torch.float32, native, salt=4)
    # A parameter (a leaf that requires grad) is summed in place like torch's all_reduce does.
    for algo in ALGOS:
        param = torch.nn.Parameter(_input(rank, 1001, torch.float64, salt=3))
        all_reduce(param, algorithm=algo)
        out[(algo, "parameter", 1001)] = _check(param.detach(), rank, world_size, 1001, torch.float64, param.detach(), salt=3)
    # native through our entry point too
    x = _input(rank, 1001, torch.int64)
    all_reduce(x, algorithm="native")
    out[("native", "int64", 1001)] = _check(x, rank, world_size, 1001, torch.int64, x)

    errors = {}
    for name, call in {
        "algorithm": lambda: all_reduce(torch.ones(4), algorithm="butterfly"),
        "contiguous": lambda: all_reduce(torch.ones(4, 4).t(), algorithm="ring"),
        "bool": lambda: all_reduce(torch.ones(4, dtype=torch.bool), algorithm="tree"),
        "type": lambda: all_reduce([1.0, 2.0], algorithm="ring"),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"

    halves = _halves(rank, world_size)
    sub = {}
    if world_size == 4:
        # Two disjoint pairs, {0, 2} and {1, 3}: group ranks differ from global ranks,
        # so a wrong translation sends to the wrong peer and the sums come out wrong.
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        mine = evens if rank % 2 == 0 else odds
        members = [0, 2] if rank % 2 == 0 else [1, 3]
        outsider = odds if rank % 2 == 0 else evens
        for algo in [*ALGOS, "native"]:
            x = _input(rank, 1001, torch.int64)
            all_reduce(x, algorithm=algo, group=mine)
            expected = sum(_input(r, 1001, torch.int64) for r in members)
            sub[algo] = torch.equal(x, expected)
        try:
            all_reduce(torch.ones(3), algorithm="ring", group=outsider)
            sub["outsider"] = None
        except ValueError as e:
            sub["outsider"] = str(e)
    return out, errors, sub, halves


HALF_SIZES = [0, 1, 2, 3, 7, 12, 1001, 70_000]  # under, at and over the world size; padded (12) and not


def _halves(rank: int, world_size: int) -> dict:
    """The ring's halves alone: (ok, sent bytes, expected sent bytes) per case. Rank r's chunk after the
    reduce-scatter is the exact sum's chunk r (at 2 ranks gloo's all-reduce's bits there); after the all-gather
    every chunk is its owner's. Then the same through a ``RingQueue``, interleaved with the default group's
    all-reduces, and a bad ``out``."""
    out: dict = {}
    peers = Peers.of()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in HALF_SIZES:
            for segment_nbytes in (40, 1 << 20) if numel <= 1001 else (4000, 1 << 20):  # 10 or 1,000 a segment
                lo, hi = chunk_bounds(numel, world_size)[rank]
                x = _input(rank, numel, dtype, salt=5)
                native = x.clone()
                dist.all_reduce(native)
                before = peers.sent_nbytes
                into = torch.full((hi - lo,), 7, dtype=dtype)
                ring_reduce_scatter(x.clone(), peers, out=into, segment_nbytes=segment_nbytes)
                ring_reduce_scatter(x, peers, segment_nbytes=segment_nbytes)
                rs_sent = (peers.sent_nbytes - before) // 2
                inputs = [_input(r, numel, dtype, salt=5).double()[lo:hi] for r in range(world_size)]
                exact = sum(inputs)
                tol = 0.0  # integers: exact; floats: each partial sum rounds once (as _check)
                if dtype.is_floating_point and hi > lo:
                    tol = (world_size - 1) * torch.finfo(dtype).eps * sum(t.abs() for t in inputs).max().item()
                rs_ok = torch.equal(into, x[lo:hi]) and (
                    hi == lo or (x[lo:hi].double() - exact).abs().max().item() <= tol)
                bits_as_native = torch.equal(x[lo:hi], native[lo:hi])
                # the all-gather: chunk r from this rank, the rest garbage to be overwritten
                mine = torch.full((numel,), -3, dtype=dtype)
                mine[lo:hi] = _input(rank, numel, dtype, salt=6)[lo:hi]
                before = peers.sent_nbytes
                ring_all_gather(mine, peers, segment_nbytes=segment_nbytes)
                ag_sent = peers.sent_nbytes - before
                whole = torch.cat([_input(r, numel, dtype, salt=6)[a:b]
                                   for r, (a, b) in enumerate(chunk_bounds(numel, world_size))])
                size = dtype.itemsize
                nxt = chunk_bounds(numel, world_size)[(rank + 1) % world_size]
                out[(str(dtype), numel, segment_nbytes)] = {
                    "reduce_scatter": rs_ok, "bits_as_native": bits_as_native, "all_gather": torch.equal(mine, whole),
                    "rs_sent": rs_sent, "rs_expected": (numel - (hi - lo)) * size,
                    "ag_sent": ag_sent, "ag_expected": (numel - (nxt[1] - nxt[0])) * size if world_size > 1 else 0}
    out["queued"] = _queued(rank, world_size)
    try:
        ring_reduce_scatter(torch.zeros(12), peers, out=torch.zeros(5))
        out["bad_out"] = None
    except ValueError as e:
        out["bad_out"] = str(e)
    return out


def _queued(rank: int, world_size: int) -> dict:
    """Reduce-scatters and all-gathers through a ``RingQueue`` (its own group and thread), launched back to back
    with the default group's all-reduces between them, then waited in launch order."""
    ring = RingQueue(dist.group.WORLD)
    numel = 12 * world_size + 0  # padded: every chunk as long
    size = numel // world_size
    works, expected, natives = [], [], []
    for i in range(6):
        x = _input(rank, numel, torch.float32, salt=20 + i)
        if i % 2 == 0:
            target = torch.empty(size)
            works.append((ring.reduce_scatter(x, out=target, label=f"bucket {i}"), target))
            expected.append(sum(_input(r, numel, torch.float32, salt=20 + i) for r in range(world_size))
                            [rank * size:(rank + 1) * size])
        else:
            flat = torch.zeros(numel)
            flat[rank * size:(rank + 1) * size] = x[rank * size:(rank + 1) * size]
            works.append((ring.all_gather(flat, label=f"bucket {i}"), flat))
            expected.append(torch.cat([_input(r, numel, torch.float32, salt=20 + i)[r * size:(r + 1) * size]
                                       for r in range(world_size)]))
        native = torch.full((3,), float(rank))
        natives.append((dist.all_reduce(native, async_op=True), native))  # the caller's group, meanwhile
    results = []
    for (work, got), want in zip(works, expected):
        work.wait()
        results.append(work.is_completed() and work.get_future().done()
                       and (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()))
    for work, native in natives:
        work.wait()
        results.append(torch.equal(native, torch.full((3,), float(sum(range(world_size))))))
    per_half = (world_size - 1) * size * 4
    return {"ok": results, "sent": ring.sent_nbytes, "expected_sent": 6 * per_half,
            "describe": works[0][0].describe}


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=full_only("~17 s, a third group")), 4],
                ids=lambda n: f"{n}ranks")
def group_results(request):
    world_size = request.param
    return world_size, run_ranks(_cases, world_size=world_size, timeout_s=240)


def test_sum_matches_exact_and_native(group_results):
    world_size, results = group_results
    for key, (err, vs_native, tol, _) in results[0][0].items():
        _, dtype, numel = key
        assert err <= tol, f"{key} on {world_size} ranks: error {err} > tolerance {tol}"
        if dtype.startswith("torch.int") or key[0] == "native":
            assert err == 0 and vs_native == 0, f"{key}: integer sums must be exact"
        elif world_size == 2:
            # Two addends round once whichever way round they are added: bit-equal to gloo.
            assert vs_native == 0, f"{key} on 2 ranks differs from gloo's sum by {vs_native}"
        else:
            assert vs_native <= 2 * tol, f"{key}: {vs_native} from gloo's sum"


def test_every_rank_ends_with_the_same_bits(group_results):
    world_size, results = group_results
    for key in results[0][0]:
        digests = {rank_results[0][key][3] for rank_results in results}
        assert len(digests) == 1, f"{key}: ranks disagree ({world_size} ranks)"


def test_bad_input_is_rejected_by_name(group_results):
    _, results = group_results
    errors = results[0][1]
    assert "algorithm='butterfly'" in errors["algorithm"] and "'ring'" in errors["algorithm"]
    assert "contiguous" in errors["contiguous"]
    assert "torch.bool" in errors["bool"]
    assert errors["type"].startswith("TypeError") and "torch.Tensor" in errors["type"]


@pytest.mark.parametrize("group_results", [4], indirect=True, ids=["4ranks"])
def test_subgroups_use_group_ranks(group_results):
    world_size, results = group_results
    assert world_size == 4  # sub-groups {0,2} and {1,3} need 4 ranks
    for rank_results in results:
        sub = rank_results[2]
        assert sub["ring"] and sub["tree"] and sub["native"]
        assert "not a member" in sub["outsider"]


def test_ring_halves_alone(group_results):
    world_size, results = group_results
    for rank, rank_results in enumerate(results):
        halves = rank_results[3]
        for key, got in halves.items():
            if not isinstance(key, tuple):
                continue
            assert got["reduce_scatter"] and got["all_gather"], f"rank {rank} of {world_size}, {key}: {got}"
            # each half sends the buffer less one chunk: (N-1)/N of it where padded, a ring all-reduce's half
            assert got["rs_sent"] == got["rs_expected"] and got["ag_sent"] == got["ag_expected"], (key, got)
            if world_size == 2 or key[0] == "torch.int64":  # one addition of two values: gloo's bits
                assert got["bits_as_native"], (key, got)
        assert halves["bad_out"].startswith("ring_reduce_scatter: out has 5 elements"), halves["bad_out"]


def test_ring_queue_runs_in_launch_order_beside_the_callers_group(group_results):
    world_size, results = group_results
    for rank_results in results:
        queued = rank_results[3]["queued"]
        assert all(queued["ok"]), queued
        assert queued["sent"] == queued["expected_sent"], queued  # (N-1)/N of each buffer, each op
        assert queued["describe"] == f"ring reduce-scatter of bucket 0 ({12 * world_size} x torch.float32)"


def test_without_process_group_the_error_says_so():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        all_reduce(torch.ones(3), algorithm="ring")


def _peer_goes_missing(rank: int, world_size: int):
    """Rank 1 never joins the all-reduce (nor the queued reduce-scatter): rank 0 must fail within the group
    timeout, the queued op with a RuntimeError at its wait naming it, and the op queued behind it at once."""
    ring = RingQueue(dist.group.WORLD)  # both ranks make its group; the ring group takes the 3 s timeout
    if rank == 1:
        time.sleep(10)  # past rank 0's four timeouts of 3 s but the last (whose peer then leaves: an error too)
        return None
    outcomes = {}
    t0 = time.monotonic()
    first = ring.reduce_scatter(torch.ones(1000), out=torch.empty(500), label="bucket 7")
    second = ring.all_gather(torch.ones(1000), label="bucket 8")
    for name, work in (("queued", first), ("queued_behind", second)):
        try:
            work.wait()
            outcomes[name] = ("returned", time.monotonic() - t0)
        except RuntimeError as e:
            outcomes[name] = (str(e), time.monotonic() - t0)
    for algo in ALGOS:
        t0 = time.monotonic()
        try:
            all_reduce(torch.ones(1000), algorithm=algo)
            outcomes[algo] = ("returned", time.monotonic() - t0)
        except RuntimeError as e:
            outcomes[algo] = (str(e), time.monotonic() - t0)
    return outcomes


def test_missing_peer_is_an_error_not_a_hang():
    outcomes = run_ranks(_peer_goes_missing, world_size=2, pg_timeout_s=3, timeout_s=60)[0]
    message, elapsed_s = outcomes.pop("queued")
    assert message.startswith("lockstep ring reduce-scatter of bucket 7 (1,000 x torch.float32) failed on global "
                              "rank 0"), message
    assert elapsed_s < 10, f"the queued reduce-scatter took {elapsed_s:.1f} s to fail"
    message, elapsed_s = outcomes.pop("queued_behind")
    assert message.startswith("lockstep ring all-gather of bucket 8 (1,000 x torch.float32): not run, an earlier "
                              "ring op failed: lockstep ring reduce-scatter of bucket 7"), message
    assert elapsed_s < 10
    for algo, (message, elapsed_s) in outcomes.items():
        assert f"lockstep {algo} all-reduce" in message and "global rank 0" in message, message
        assert elapsed_s < 10, f"{algo}: took {elapsed_s:.1f} s to fail"


def test_chunk_bounds_cover_the_buffer_once():
    for numel in [0, 1, 3, 7, 8, 1001]:
        for parts in range(1, 9):
            bounds = chunk_bounds(numel, parts)
            assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_short_chunks_go_whole_and_long_ones_in_segments():
    mib_f32 = (1 << 20) // 4
    # 2 ranks x 4 MiB: 2 MiB chunks go as one message; 3 MiB ones are cut into 1 MiB segments.
    assert pick_segment_numel(2 * mib_f32, 1 << 20, 4) == 2 * mib_f32
    assert pick_segment_numel(3 * mib_f32, 1 << 20, 4) == mib_f32
    assert pick_segment_numel(500, 40, 4) == 10
    assert pick_segment_numel(0, 40, 4) == 1
    with pytest.raises(ValueError, match="segment_nbytes"):
        pick_segment_numel(500, 0, 4)


def test_receive_scratch_is_reused_per_thread_and_dtype():
    like = torch.zeros(3)
    a = receive_scratch(like, 1000)
    b = receive_scratch(like, 500)
    assert a.numel() == 1000 and b.numel() == 500 and a.data_ptr() == b.data_ptr()
    grown = receive_scratch(like, 4000)
    assert grown.numel() == 4000 and receive_scratch(like, 10).data_ptr() == grown.data_ptr()
    other_dtype = receive_scratch(torch.zeros(3, dtype=torch.float64), 10)
    assert other_dtype.dtype == torch.float64 and other_dtype.data_ptr() != grown.data_ptr()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(receive_scratch(like, 10).data_ptr()))
    worker.start()
    worker.join()
    assert seen and seen[0] != grown.data_ptr()  # another thread never gets this thread's buffer
