"""DistributedSampler: torch's index sharding, plus a position you can save and resume mid-epoch.

For the same (dataset length, num_replicas, rank, shuffle, seed, drop_last, epoch) it
yields exactly the indices of ``torch.utils.data.distributed.DistributedSampler``, so
it is a drop-in. The one idea: a rank's indices are a pure function of those
arguments, so a saved position is just (epoch, seed, how many of this rank's indices
the training loop has consumed) — a few integers that ``torch.load(weights_only=True)``
reads back — and resuming means skipping that many.

Resuming at another world size: ranks take the epoch's global order round-robin
(rank r gets global positions r, r + R, r + 2R, ...), so after every rank has consumed
c indices the consumed part is exactly the prefix [0, c * R) of the global order. The
state carries that global ``position``; a sampler with R' replicas continues the same
order from it (rank r' gets position + r', position + r' + R', ...), so across the resize
every sample of the epoch is used once. ``pad``: the new layout's last round is padded by
repeating the epoch's first indices, as torch pads (at most R' - 1 repeats).
``drop_last``: the remainder that does not fill a round of R' is dropped (fewer than R'
samples; which ones depends on where the resize happened). ``pad=False`` shards differ in
length by one, so a position past the shortest shard is not the same on every rank: such
a state is refused at another world size.

Counting consumption honestly: a DataLoader with workers pulls indices from the
sampler ``prefetch_factor * num_workers`` batches ahead of the loop body, so "how many
indices were yielded" over-counts. Tell the sampler what the loop really consumed,
either with ``advance(n)`` after each step or with ``state_dict(consumed=n)``; without
either, the yielded count is used, which is exact only for ``num_workers=0``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class DistributedSampler(Sampler[int]):
    """Shards a dataset's indices across ranks, identically to torch's sampler, resumably.

    Args:
        dataset: anything with ``__len__``; only its length is read.
        num_replicas: number of ranks sharing the data. Default: the size of ``group``
            (or of the default process group). Passing it explicitly is preferred.
        rank: this rank, in ``[0, num_replicas)``. Default: the rank in ``group``.
        shuffle: shuffle with a generator seeded ``seed + epoch`` (same as torch).
        seed: base seed; every rank must use the same one.
        drop_last: drop the tail so every rank gets ``len // num_replicas`` indices.
            When False (torch's default), the list is padded by repeating indices from
            its start so that every rank gets ``ceil(len / num_replicas)``.
        pad: keyword-only, lockstep's addition. ``pad=False`` (only with
            ``drop_last=False``) gives rank r the indices ``perm[r::num_replicas]`` with no
            padding, so across ranks every sample appears exactly once; ranks may then
            differ by one in length. Use it for evaluation, where a padded duplicate would
            be counted twice. Training keeps the default ``pad=True`` (equal steps on all
            ranks, which DDP needs).
        group: keyword-only process group to read defaults from.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"DistributedSampler needs a dataset with __len__, got {type(dataset).__name__}")
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                missing = "num_replicas" if num_replicas is None else "rank"
                raise RuntimeError(
                    f"DistributedSampler: {missing} was not given and no process group is initialised; "
                    "pass num_replicas= and rank= explicitly, or call lockstep.init() first"
                )
            if num_replicas is None:
                num_replicas = dist.get_world_size(group)
            if rank is None:
                rank = dist.get_rank(group)
        for name, value in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DistributedSampler: {name} must be an int, got {value!r}")
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"DistributedSampler: rank {rank} is out of range for num_replicas {num_replicas} "
                f"(valid ranks: 0..{num_replicas - 1})"
            )
        if not pad and drop_last:
            raise ValueError("DistributedSampler: pad=False only applies with drop_last=False (nothing to pad)")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.pad = bool(pad)
        self.epoch = 0
        self._start = 0  # position the next __iter__ starts from (set by load_state_dict)
        self._yielded = 0  # indices handed out in this epoch, counted from position 0
        self._advanced: int | None = None  # what advance() reported for this epoch, if used
        self._counting = False  # advance() was called since the epoch (or its resumed part) began
        self._phase = 0  # global position of this layout's position 0 (load_state_dict at another world size)
        self._resumed = False  # a loaded position waits for the next __iter__

    # -- sizes -------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Indices this rank gets per epoch (torch's attribute of the same name)."""
        return self._count(self._phase)

    def _count(self, phase: int) -> int:
        # phase: the global position this layout's position 0 sits at; 0 except in an epoch
        # resumed at another world size (position 0 of rank r is global position phase + r).
        n, r = len(self.dataset) - phase, self.num_replicas
        if self.drop_last:
            return n // r  # the tail that does not fill a round is dropped
        if not self.pad:
            return len(range(self.rank, n, r))
        return -(-n // r)  # ceil: short ranks are padded

    @property
    def total_size(self) -> int:
        return self._phase + self.num_samples * self.num_replicas if self.pad else len(self.dataset)

    def __len__(self) -> int:
        """How many indices the next ``__iter__`` yields: ``num_samples`` less a resumed position."""
        return self._count(self._phase) - self._start if self._resumed else self._count(0)

    # -- iteration ---------------------------------------------------------------------
    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        # Same generator, seed and call as torch's sampler: that is what makes the indices equal.
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        n = len(order)
        if not self._resumed:
            self._phase = 0  # a loaded position (and its phase) applies to one iteration only
        start, self._start, self._resumed = self._start, 0, False
        self._yielded = start
        self._advanced = None if start == 0 else start
        self._counting = False
        # Position j of this rank is global position phase + rank + j * num_replicas of the list
        # padded by wrapping around (order[i % n]): exactly torch's padding, never built.
        first = self._phase + self.rank
        for j in range(start, self.num_samples):
            self._yielded = j + 1  # counted as it is handed out: the generator pauses at the yield
            yield order[(first + j * self.num_replicas) % n]

    @property
    def consumed(self) -> int:
        """Indices reported consumed this epoch through ``advance()`` (a resumed position included once
        iteration has begun); the position the loop body is at, whatever the loader prefetched."""
        return self._advanced or 0

    def indices(self, start: int, stop: int) -> list[int]:
        """This rank's dataset indices at positions ``[start, stop)`` of the current epoch (what
        ``__iter__`` yields there). For audit logs: the permutation is cached per epoch, one
        ``randperm`` per epoch rather than per call."""
        key = (self.epoch, self.seed, len(self.dataset), self.shuffle)
        cached = getattr(self, "_order_cache", None)
        if cached is None or cached[0] != key:
            cached = self._order_cache = (key, self._order())
        order, n, first = cached[1], len(cached[1]), self._phase + self.rank
        return [order[(first + j * self.num_replicas) % n] for j in range(start, min(stop, self.num_samples))]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle. Re-setting the epoch just loaded keeps the resumed position."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"DistributedSampler.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self._start = 0
            self._yielded = 0
            self._advanced, self._counting = None, False
            self._phase, self._resumed = 0, False
        self.epoch = epoch

    # -- resumable state ---------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Record that the training loop consumed ``n`` more indices of this epoch.

        Call it once per step with the batch size (the Trainer does). Once used in an
        epoch, ``state_dict()`` saves this count instead of the yielded one, which a
        prefetching DataLoader runs ahead of.
        """
        if n < 0:
            raise ValueError(f"DistributedSampler.advance: n must be >= 0, got {n}")
        total = (self._advanced or 0) + n
        if total > self.num_samples:
            raise ValueError(
                f"DistributedSampler.advance: {total} consumed exceeds the {self.num_samples} "
                f"indices rank {self.rank} has in an epoch"
            )
        self._advanced, self._counting = total, True

    def state_dict(self, consumed: int | None = None) -> dict:
        """Plain ints and bools: epoch, seed, the global position, this rank's count and the layout to check.

        ``position`` is the number of the epoch's global order consumed by all ranks together
        (every rank is at the same count in a DDP loop); ``consumed`` is this rank's count.
        ``consumed`` overrides the count; otherwise ``advance()``'s total is used if it was
        called this epoch, else the number of indices yielded.
        """
        if consumed is None:
            # a loop that never calls advance() (no prefetching workers) is where it yielded, a resumed one too
            consumed = self._advanced if self._counting else self._yielded
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"DistributedSampler.state_dict: consumed={consumed} is outside [0, {self.num_samples}] "
                f"for rank {self.rank}"
            )
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": int(consumed),
            "position": self._phase + int(consumed) * self.num_replicas,
            "rank": self.rank,
            "num_replicas": self.num_replicas,
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``__iter__`` yields exactly the indices of the epoch not yet consumed.

        Epoch and seed come from the state. The dataset length, shuffle, drop_last and pad
        must match (they decide the global order). ``num_replicas`` may differ: the run goes
        on from the saved global position (module docstring), except for a ``pad=False``
        state past the shortest shard, where ranks stood at different positions.
        """
        for key in ("epoch", "seed", "consumed"):
            if key not in state:
                raise KeyError(f"DistributedSampler.load_state_dict: state has no {key!r}")
        current = {
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
        }
        for key, mine in current.items():
            if key in state and state[key] != mine:
                raise ValueError(
                    f"DistributedSampler.load_state_dict: saved {key}={state[key]!r} but this sampler has "
                    f"{key}={mine!r}; the epoch's global order would differ, so no exact resume"
                )
        saved_replicas = int(state.get("num_replicas", self.num_replicas))
        consumed = int(state["consumed"])
        position = int(state.get("position", consumed * saved_replicas))  # states before lockstep 0.x had no position
        n = len(self.dataset)
        if saved_replicas == self.num_replicas:
            phase, start = position % saved_replicas, position // saved_replicas
        else:
            if not self.pad and consumed > (n - position % saved_replicas) // saved_replicas:
                raise ValueError(
                    f"DistributedSampler.load_state_dict: cannot resume a pad=False state at num_replicas="
                    f"{self.num_replicas} (saved {saved_replicas}): consumed={consumed} is past the shortest "
                    f"shard, where ranks stood at different positions and no global position is shared"
                )
            position = min(position, n)  # past n: only the padding of the last round was left
            phase, start = position % self.num_replicas, position // self.num_replicas
        if position < 0 or start > self._count(phase):
            raise ValueError(
                f"DistributedSampler.load_state_dict: position={position} is outside this epoch "
                f"(dataset_len={n}, num_replicas={self.num_replicas})"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self._phase, self._start, self._resumed = phase, start, True
        self._yielded = start
        self._advanced, self._counting = None, False
