"""DistributedSampler: same indices as torch's, exact mid-epoch resume, the eval (no padding) mode, errors.

No process group is needed for most of it: the sampler takes num_replicas and rank
explicitly. One test starts a single-rank gloo group in-process to check the defaults.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from dist_utils import free_port
from lockstep import DistributedSampler


class Indexed(Dataset):
    """Returns its own index, so a DataLoader's batches show which indices were read."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


LENGTHS = [0, 1, 2, 3, 5, 7, 8, 10, 13, 64, 101]


@pytest.mark.parametrize("n", LENGTHS)
def test_same_indices_as_torch(n):
    data = Indexed(n)
    for world, shuffle, seed, drop_last in itertools.product([1, 2, 3, 4], [True, False], [0, 7], [False, True]):
        for rank in range(world):
            ours = DistributedSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            ref = TorchSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            for epoch in range(3):
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
                case = f"n={n} world={world} rank={rank} shuffle={shuffle} seed={seed} drop_last={drop_last} epoch={epoch}"
                assert list(ours) == list(ref), case
                assert len(ours) == len(ref) == ours.num_samples, case


def test_padding_repeats_indices_like_torch_when_smaller_than_replicas():
    # 3 samples over 8 ranks: torch pads by wrapping around the list more than once.
    data = Indexed(3)
    ours = [list(DistributedSampler(data, 8, r, shuffle=False)) for r in range(8)]
    assert ours == [list(TorchSampler(data, 8, r, shuffle=False)) for r in range(8)]
    assert [x for shard in ours for x in shard] == [0, 1, 2, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("n,world", [(10, 3), (7, 4), (3, 4), (12, 4), (0, 2)])
def test_eval_mode_counts_every_sample_once(n, world):
    data = Indexed(n)
    for shuffle in (False, True):
        shards = [list(DistributedSampler(data, world, r, shuffle=shuffle, seed=3, pad=False)) for r in range(world)]
        flat = sorted(x for s in shards for x in s)
        assert flat == list(range(n))  # no duplicates, nothing missing
        lengths = [len(s) for s in shards]
        assert max(lengths) - min(lengths) <= 1 if n else lengths == [0] * world
        padded = [list(DistributedSampler(data, world, r, shuffle=shuffle, seed=3)) for r in range(world)]
        if n % world:
            # the default (torch's) layout duplicates some samples: exactly why eval must not use it
            assert sum(map(len, padded)) > n
        # the un-padded shard is a prefix of the padded one: same order, the duplicate tail removed
        for s, p in zip(shards, padded):
            assert p[: len(s)] == s


@pytest.mark.parametrize("consumed", [0, 1, 4, 9, 10])
def test_resume_mid_epoch_yields_exactly_the_rest(consumed):
    data = Indexed(41)
    for rank in range(3):
        full = DistributedSampler(data, 3, rank, seed=11)
        full.set_epoch(2)
        expected = list(full)
        first = DistributedSampler(data, 3, rank, seed=11)
        first.set_epoch(2)
        it = iter(first)
        head = [next(it) for _ in range(consumed)]
        state = first.state_dict()
        assert state["epoch"] == 2 and state["seed"] == 11 and state["consumed"] == consumed
        # the resumed sampler is built with a different seed: the state's seed wins
        second = DistributedSampler(data, 3, rank, seed=999)
        second.load_state_dict(state)
        second.set_epoch(2)  # a training loop re-sets the epoch it resumes: the position survives
        assert len(second) == len(expected) - consumed
        assert head + list(second) == expected
        # the epoch after a resumed one starts from its beginning
        second.set_epoch(3)
        full.set_epoch(3)
        assert list(second) == list(full)
        # and re-iterating the same epoch after the resumed pass starts from 0 too
        assert list(second) == list(full)


def test_state_dict_is_plain_and_loads_with_weights_only(tmp_path):
    s = DistributedSampler(Indexed(20), 2, 1, seed=5)
    s.set_epoch(4)
    it = iter(s)
    for _ in range(3):
        next(it)
    path = tmp_path / "s.pt"
    torch.save(s.state_dict(), path)
    state = torch.load(path, weights_only=True)
    t = DistributedSampler(Indexed(20), 2, 1)
    t.load_state_dict(state)
    assert t.epoch == 4 and t.seed == 5 and len(t) == 10 - 3


def _batches(loader, k=None):
    out = []
    for i, batch in enumerate(loader):
        if k is not None and i == k:
            break
        out.append(batch.tolist())
    return out


def test_resume_through_a_prefetching_dataloader():
    """With workers the sampler runs ahead of the loop; advance() records what was really consumed."""
    data = Indexed(203)
    batch_size, stop_after = 4, 5

    def loader_for(sampler):
        return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=2, prefetch_factor=2)

    full = DistributedSampler(data, 2, 0, seed=1)
    full.set_epoch(1)
    expected = _batches(DataLoader(data, batch_size=batch_size, sampler=full))

    first = DistributedSampler(data, 2, 0, seed=1)
    first.set_epoch(1)
    loader = loader_for(first)
    head = []
    for i, batch in enumerate(loader):
        head.append(batch.tolist())
        first.advance(len(batch))
        if i + 1 == stop_after:
            break
    consumed = stop_after * batch_size
    assert first._yielded > consumed  # the workers' prefetch pulled indices the loop never saw
    state = first.state_dict()
    assert state["consumed"] == consumed
    del loader

    second = DistributedSampler(data, 2, 0, seed=1)
    second.load_state_dict(state)
    second.set_epoch(1)
    tail = _batches(loader_for(second))
    assert head + tail == expected


def test_state_dict_consumed_argument_overrides_counts():
    s = DistributedSampler(Indexed(10), 2, 0, shuffle=False)
    list(s)
    assert s.state_dict()["consumed"] == 5
    assert s.state_dict(consumed=2)["consumed"] == 2
    t = DistributedSampler(Indexed(10), 2, 0, shuffle=False)
    t.load_state_dict(s.state_dict(consumed=2))
    assert list(t) == [4, 6, 8]


def test_bad_arguments():
    data = Indexed(10)
    with pytest.raises(ValueError, match=r"rank 2 is out of range for num_replicas 2"):
        DistributedSampler(data, 2, 2)
    with pytest.raises(ValueError, match=r"rank -1 is out of range for num_replicas 3"):
        DistributedSampler(data, 3, -1)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        DistributedSampler(data, 0, 0)
    with pytest.raises(TypeError, match="seed must be an int"):
        DistributedSampler(data, 2, 0, seed=1.5)
    with pytest.raises(TypeError, match="dataset with __len__"):
        DistributedSampler(iter(range(3)), 2, 0)
    with pytest.raises(ValueError, match="pad=False only applies with drop_last=False"):
        DistributedSampler(data, 2, 0, drop_last=True, pad=False)
    s = DistributedSampler(data, 2, 0)
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        s.set_epoch(-1)
    with pytest.raises(ValueError, match=r"consumed=6 is outside \[0, 5\]"):
        s.state_dict(consumed=6)
    with pytest.raises(ValueError, match="advance: 6 consumed exceeds the 5 indices rank 0"):
        s.advance(6)
    state = s.state_dict()
    with pytest.raises(ValueError, match="saved dataset_len=10 but this sampler has dataset_len=11"):
        DistributedSampler(Indexed(11), 2, 0).load_state_dict(state)
    with pytest.raises(ValueError, match="saved drop_last=False but this sampler has drop_last=True"):
        DistributedSampler(data, 3, 0, drop_last=True).load_state_dict(state)
    # pad=False: 10 over 4 ranks gives shards of 3, 3, 2, 2; past 2 the ranks stood apart
    late = DistributedSampler(data, 4, 0, pad=False).state_dict(consumed=3)
    with pytest.raises(ValueError, match=r"pad=False state at num_replicas=2 \(saved 4\): consumed=3 is past"):
        DistributedSampler(data, 2, 0, pad=False).load_state_dict(late)
    with pytest.raises(ValueError, match="position=99 is outside this epoch"):
        DistributedSampler(data, 2, 0).load_state_dict({**state, "position": 99, "num_replicas": 2})
    with pytest.raises(KeyError, match="'consumed'"):
        DistributedSampler(data, 2, 0).load_state_dict({"epoch": 0, "seed": 0})


def test_defaults_come_from_the_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="num_replicas was not given and no process group is initialised"):
        DistributedSampler(Indexed(4))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        s = DistributedSampler(Indexed(4), shuffle=False)
        assert (s.num_replicas, s.rank) == (1, 0)
        assert list(s) == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="rank 3 is out of range for num_replicas 1"):
            DistributedSampler(Indexed(4), rank=3)
    finally:
        dist.destroy_process_group()


# -- resuming at another world size ------------------------------------------------------------
def _interleave(shards):
    """Global order from per-rank lists: round j takes each rank's j-th index, in rank order."""
    out = []
    for j in range(max(map(len, shards), default=0)):
        out += [s[j] for s in shards if j < len(s)]
    return out


def _resize_case(n, old, new, seed, drop_last, pad, rng):
    data = Indexed(n)
    kw = {"shuffle": True, "seed": seed, "drop_last": drop_last, "pad": pad}
    before = [DistributedSampler(data, old, r, **kw) for r in range(old)]
    for s in before:
        s.set_epoch(3)
    shortest = min(s.num_samples for s in before)
    consumed = rng.randint(0, shortest)  # a DDP loop keeps every rank at the same count
    heads = [list(s)[:consumed] for s in before]
    states = [s.state_dict(consumed=consumed) for s in before]
    assert len({st["position"] for st in states}) == 1  # every rank saves the same global position
    after = [DistributedSampler(data, new, r, seed=12345, shuffle=True, drop_last=drop_last, pad=pad) for r in range(new)]
    for s, st in zip(after, [states[0]] * new):  # any rank's state will do: the position is global
        s.load_state_dict(st)
        s.set_epoch(3)
    tails = [list(s) for s in after]
    assert len({len(t) for t in tails}) == 1 or not pad  # DDP needs equal steps: padded/dropped layouts give them
    consumed_order = _interleave(heads) + _interleave(tails)
    g = torch.Generator()
    g.manual_seed(seed + 3)
    order = torch.randperm(n, generator=g).tolist()
    case = f"n={n} {old}->{new} seed={seed} drop_last={drop_last} pad={pad} consumed={consumed}"
    # the global order, from its start, with no gap and nothing twice ...
    assert consumed_order == [order[i % n] for i in range(len(consumed_order))], case
    if drop_last:  # ... less a tail shorter than a round of either world size ...
        assert n - len(consumed_order) < max(old, new), case
    elif pad:  # ... or with fewer than a round of repeats from the epoch's start, as torch pads
        assert 0 <= len(consumed_order) - n < max(old, new), case
    else:
        assert len(consumed_order) == n, case
    return consumed


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (3, 2), (2, 3), (4, 3), (3, 3)])
def test_resize_uses_every_sample_of_the_epoch_once(old, new):
    import random

    rng = random.Random(old * 10 + new)
    positions = set()
    for _ in range(150):
        n = rng.randint(max(old, new), 90)
        drop_last = rng.random() < 0.3
        pad = drop_last or rng.random() < 0.8
        positions.add(_resize_case(n, old, new, rng.randint(0, 10**6), drop_last, pad, rng))
    assert len(positions) > 10  # the draw did reach positions across the epoch


def test_resize_then_next_epoch_is_the_new_world_sizes_own_layout():
    data = Indexed(37)
    s = DistributedSampler(data, 4, 1, seed=2)
    s.set_epoch(0)
    state = s.state_dict(consumed=5)
    t = DistributedSampler(data, 2, 1, seed=2)
    t.load_state_dict(state)
    t.set_epoch(0)
    assert state["position"] == 20 and len(t) == 9 and list(t) == t.indices(10, 19)
    t.set_epoch(1)
    ref = TorchSampler(data, 2, 1, seed=2)
    ref.set_epoch(1)
    assert list(t) == list(ref) and len(t) == len(ref)


def test_resumed_loop_without_advance_saves_where_it_stands():
    """A loop that never calls advance() (no prefetching workers) and resumed mid-epoch: state_dict() counts what
    was yielded since, not the resumed position again (which made a second resume repeat the samples between)."""
    sampler = DistributedSampler(list(range(40)), num_replicas=2, rank=0, shuffle=True, seed=1)
    it = iter(sampler)
    for _ in range(6):
        next(it)
    resumed = DistributedSampler(list(range(40)), num_replicas=2, rank=0, shuffle=True, seed=1)
    resumed.load_state_dict(sampler.state_dict())
    it = iter(resumed)
    for _ in range(4):
        next(it)
    assert resumed.state_dict()["position"] == (6 + 4) * 2
    resumed.advance(0)  # a loop that does call advance() is counted by it, from the resumed position
    assert resumed.state_dict()["position"] == 6 * 2
