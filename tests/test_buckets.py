"""Bucket assignment: reverse order, small first bucket, torch's closing rule and layout, dtype separation."""

import pytest
import torch

from lockstep.ddp.buckets import MIB, assign_buckets


def _params(*numels, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for n in numels]


def test_reverse_order_and_first_bucket():
    # 10 tensors of 0.5 MiB (fp32: 131072 elements) in registration order.
    params = _params(*[131072] * 10)
    plans = assign_buckets(params, list(reversed(range(10))), bucket_cap_bytes=2 * MIB, first_bucket_bytes=1 * MIB)
    layout = [p.param_indices for p in plans]
    assert layout == [[9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]
    assert plans[0].nbytes == 1 * MIB
    assert [p.offsets for p in plans] == [[0, 131072], [0, 131072, 262144, 393216], [0, 131072, 262144, 393216]]


@pytest.mark.parametrize("cap_mb", [0.001, 0.3, 1, 3])
def test_caps_close_buckets_as_torchs_ddp(cap_mb):
    torch.manual_seed(0)
    numels = torch.randint(1, 200_000, (40,)).tolist()
    params = _params(*numels)
    cap = int(cap_mb * MIB)
    plans = assign_buckets(params, list(reversed(range(40))), bucket_cap_bytes=cap, first_bucket_bytes=min(cap, MIB))
    flat = [i for p in plans for i in p.param_indices]
    assert flat == list(reversed(range(40)))  # every parameter once, reverse order
    # A bucket closes once it holds its cap: every bucket but the last reached it, and was under it
    # before its last parameter came.
    for plan in plans[:-1]:
        limit = min(cap, MIB) if plan is plans[0] else cap
        assert plan.nbytes >= limit
        assert plan.nbytes - params[plan.param_indices[-1]].numel() * 4 < limit
    assert plans[-1].nbytes < cap or len(plans) == 1 or plans[-1].nbytes - params[plans[-1].param_indices[-1]].numel() * 4 < cap


@pytest.mark.parametrize("seed", range(4))
def test_layout_is_torchs(seed):
    """The same buckets as torch's own assignment (``dist._compute_bucket_assignment_by_size``, what its DDP
    rebuilds with after the first iteration), for a shuffled ready order and torch's 1 MiB first bucket, with
    and without parameters that expect sparse gradients."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed)
    params = _params(*torch.randint(1, 400_000, (60,), generator=g).tolist())
    order = torch.randperm(60, generator=g).tolist()
    # torch's expect_sparse_gradient: such a parameter (a sparse nn.Embedding's) gets a bucket of its own at once.
    sparse = (torch.rand(60, generator=g) < 0.2).tolist()
    for cap in (MIB // 2, 2 * MIB, 25 * MIB):
        for flags in ([False] * 60, sparse):
            plans = assign_buckets(params, order, bucket_cap_bytes=cap, first_bucket_bytes=MIB, sparse=flags)
            theirs, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [min(MIB, cap), cap], flags, order)
            assert [p.param_indices for p in plans] == [list(b) for b in theirs], (cap, flags)
            assert all(p.sparse == (len(p.param_indices) == 1 and flags[p.param_indices[0]]) for p in plans)


def test_observed_order_is_followed():
    params = _params(10, 20, 30, 40)
    order = [1, 3, 0, 2]
    plans = assign_buckets(params, order, bucket_cap_bytes=1)  # every parameter alone
    assert [p.param_indices for p in plans] == [[1], [3], [0], [2]]


def test_dtypes_never_share_a_bucket():
    params = _params(10, 10) + _params(10, 10, dtype=torch.bfloat16)
    plans = assign_buckets(params, [3, 2, 1, 0], bucket_cap_bytes=MIB)
    assert sorted(p.param_indices for p in plans) == [[1, 0], [3, 2]]
    assert {p.dtype for p in plans} == {torch.float32, torch.bfloat16}
    assert plans[0].dtype == torch.bfloat16  # bucket order follows the first parameter's position


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket cap"):
        assign_buckets(_params(1), [0], bucket_cap_bytes=0)
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(_params(1, 2), [0, 0], bucket_cap_bytes=10)


class _Work:
    def __init__(self, done=True):
        self._done, self.waited = done, False

    def done(self):
        return self._done

    def wait(self):
        self.waited = True


class _Bucket:
    def __init__(self, index):
        self.index, self.work = index, None


def _launch_order(n, hooked=False, work_done=True):
    from lockstep.ddp.reducer import LaunchOrder

    buckets, launched = [_Bucket(i) for i in range(n)], []

    def launch(bucket):
        launched.append(bucket.index)
        bucket.work = _Work(work_done)

    return LaunchOrder(buckets, launch, hooked), buckets, launched


def test_launch_order_holds_a_bucket_ready_early_until_the_earlier_ones_launch():
    order, _, launched = _launch_order(4)
    order.mark_ready(2)
    order.mark_ready(1)
    assert launched == []  # bucket 0 is not ready: nothing may go before it on any rank
    order.mark_ready(0)
    assert launched == [0, 1, 2]
    order.drain()
    assert launched == [0, 1, 2, 3]


def test_launch_order_with_a_hook_keeps_one_bucket_in_flight():
    order, buckets, launched = _launch_order(3, hooked=True, work_done=False)
    order.mark_ready(0)
    order.mark_ready(1)
    assert launched == [0]  # bucket 0's hook has not finished: bucket 1 waits
    order.drain()
    assert launched == [0, 1, 2] and buckets[0].work.waited and buckets[1].work.waited


class _DistWork:
    """A ``dist.Work``: ``is_completed`` instead of a Future's ``done``."""

    def __init__(self):
        self.completed, self.waited = False, False

    def is_completed(self):
        return self.completed

    def wait(self):
        self.waited = self.completed = True


def test_launch_order_in_a_sequence_on_a_slow_link_one_at_a_time():
    from lockstep.ddp.launch_order import priority_sequence
    from lockstep.ddp.reducer import LaunchOrder

    buckets, launched = [_Bucket(i) for i in range(4)], []

    def launch(bucket):
        launched.append(bucket.index)
        bucket.work = _DistWork()

    order = LaunchOrder(buckets, launch, True, priority_sequence(4, 2))  # serial: the reducer's slow-link verdict
    order.mark_ready(0)
    order.mark_ready(1)
    assert launched == [0]  # bucket 0's all-reduce is still on the wire
    buckets[0].work.completed = True
    order.mark_ready(3)
    assert launched == [0, 1]  # 3 comes after 1 in the sequence; 1 after 0 was done
    buckets[1].work.completed = True
    order.mark_ready(2)
    assert launched == [0, 1, 3]  # 3 went; 2 waits for it
    order.drain()
    assert launched == [0, 1, 3, 2] and buckets[3].work.waited


def test_one_bucket_at_a_time_only_where_the_wire_is_slow_and_set_the_end():
    from lockstep.ddp.launch_order import wire_is_slow

    assert wire_is_slow(41e6, elapsed_s=3.6, waited_s=3.5)  # 100 Mbit/s: the wire is the step
    assert not wire_is_slow(41e6, elapsed_s=0.36, waited_s=0.3)  # 1 Gbit/s: at once is as fast
    assert not wire_is_slow(41e6, elapsed_s=0.08, waited_s=0.01)  # loopback
    assert not wire_is_slow(4e3, elapsed_s=0.01, waited_s=0.001)  # a tiny model: the backward set the end
    assert not wire_is_slow(1e6, elapsed_s=0.05, waited_s=0.04)  # a small one on a loaded machine: its waits


def test_small_first_bucket_only_where_its_all_reduce_can_overlap():
    from lockstep.ddp.buckets import small_first_bucket_pays

    assert small_first_bucket_pays("cuda", 8, 16, 2)  # a GPU communicates on its own
    assert not small_first_bucket_pays("cpu", 2, 1, 2)  # 2 ranks x 1 thread on 2 cores: no core for gloo's thread
    assert not small_first_bucket_pays("cpu", 2, 4, 8)
    assert small_first_bucket_pays("cpu", 2, 4, 16)  # 8 cores left over


def test_local_ranks_from_the_launchers_environment():
    from lockstep.ddp.buckets import local_ranks_from_env

    assert local_ranks_from_env(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_ranks_from_env(8, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert local_ranks_from_env(8, {"SLURM_NTASKS_PER_NODE": "1"}) == 1
    assert local_ranks_from_env(8, {"SLURM_NTASKS_PER_NODE": "2(x4)"}) == 8  # not a count: all assumed here
    assert local_ranks_from_env(3, {}) == 3


def test_first_bucket_caps(monkeypatch):
    import torch.distributed as dist

    from lockstep.ddp.buckets import first_bucket_caps

    cap = 25 * MIB
    assert first_bucket_caps("cpu", 2, cap, small=True) == (MIB, MIB)
    assert first_bucket_caps("cpu", 2, cap, small=False) == (MIB, cap)  # the first step keeps 1 MiB whatever the wish
    assert first_bucket_caps("cuda", 2, cap) == (MIB, MIB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")  # more ranks here than cores: nothing spare
    assert first_bucket_caps("cpu", 64, cap) == (MIB, cap)
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2 * MIB)  # a script that set torch's constant keeps it
    assert first_bucket_caps("cpu", 64, cap) == (2 * MIB, 2 * MIB)
