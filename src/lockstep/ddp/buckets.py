"""Bucket assignment: which parameters share one flat buffer and one all-reduce.

A gloo all-reduce costs ~0.5 ms however small, so gradients travel in buckets of up
to ``bucket_cap_mb``. Buckets are filled in the order gradients are expected to be
ready (reverse registration order at first, the observed order after one
iteration), so the first bucket fills early in backward and its all-reduce overlaps
the rest. The first bucket is small (1 MiB) so that communication starts as soon as
possible. A bucket never mixes devices or dtypes: it is one flat tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MIB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB
# Where the launcher says how many ranks share this machine: torchrun / lockstep launch, OpenMPI, SLURM.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def small_first_bucket_pays(device_type: str, local_ranks: int, threads_per_rank: int, cores: int) -> bool:
    """Whether torch's small first bucket (1 MiB) can pay for itself on this machine.

    Its all-reduce is launched early in backward so that it runs while the rest of backward does.
    That needs something to run it on: a GPU's communication kernels, or on CPU a core that the
    ranks' compute threads leave to gloo's thread. Without one (ranks on this machine x intra-op
    threads >= cores) the early all-reduce only takes its time from backward, and it adds one
    all-reduce's fixed cost and a mid-backward meeting of the ranks: on the bench transformer at 2
    ranks x 1 thread on 2 cores, one 25 MB bucket instead of torch's 1 MiB + the rest made the step
    2% faster (0.979 of it, 12 paired blocks), on the CNN 1% (benchmarks/results, docs/performance.md).
    """
    if device_type != "cpu":
        return True
    return local_ranks * threads_per_rank < cores


def local_ranks_from_env(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """Ranks on this machine as the launcher tells it; else ``world_size`` (all here, as with mp.spawn)."""
    env = os.environ if env is None else env
    for var in _LOCAL_SIZE_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world_size


def first_bucket_caps(
    device_type: str, world_size: int, bucket_cap_bytes: int, small: bool | None = None
) -> tuple[int, int]:
    """The first bucket's cap for the first iteration, and this rank's wish for the rebuilt layout.

    The first iteration keeps the small one (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, read
    as torch's DDP reads it): every rank builds it alone, so it must not depend on the machine. The
    rebuild takes rank 0's wish (``Reducer.rebuild_buckets``): the same small first bucket where
    ``small`` (None: ``small_first_bucket_pays`` here; a script that changed torch's constant keeps
    it), else none (the first bucket has the full cap).
    """
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", DEFAULT_FIRST_BUCKET_BYTES)
    if small is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        small = first != DEFAULT_FIRST_BUCKET_BYTES or small_first_bucket_pays(
            device_type, local_ranks_from_env(world_size), torch.get_num_threads(), cores)
    return first, first if small else bucket_cap_bytes


CPU = torch.device("cpu")  # a torch.device is immutable: one instance serves as every plan's default


@dataclass
class BucketPlan:
    """One bucket's layout: parameter indices in buffer order, and where each starts."""

    param_indices: list[int]
    offsets: list[int] = field(default_factory=list)  # element offset of each parameter in the buffer
    numel: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device = CPU
    direct: bool = False  # one large parameter, all-reduced in its own gradient when it can be (``copy_in``)
    # one parameter whose gradient is sparse (``nn.Embedding(sparse=True)``): no flat buffer, numel 0
    sparse: bool = False
    # ZeRO-2 (``zero2``): the buffer holds at least this many elements, a multiple of the world size that the
    # reduce-scatter splits into equal shards (the padding stays zero); 0: numel + the spare element
    padded_numel: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def assign_buckets(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    bucket_cap_bytes: int,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    bucket_caps_bytes: Sequence[int] | None = None,
    direct_min_bytes: int | None = None,
    sparse: Sequence[bool] | None = None,
) -> list[BucketPlan]:
    """Group ``params`` (visited in ``order``, a permutation of their indices) into buckets.

    Per (device, dtype) a bucket is closed as soon as it holds at least its cap, as torch's DDP
    closes its buckets (``_compute_bucket_assignment_by_size``), so the layout is torch's: the same
    buckets for a comm hook to see, and a bucket may run over its cap by its last parameter. That
    rule also takes a large parameter into the bucket it completes rather than leaving it to the next:
    on the bench CNN the last bucket, whose all-reduce no backward hides, is then 2.1 MB, not 4.5.
    The first bucket of each (device, dtype) has cap ``first_bucket_bytes``, later ones
    ``bucket_cap_bytes``; ``bucket_caps_bytes`` instead gives every bucket's cap in
    turn (the last one repeats). Buckets are numbered in the order they close (a full one when its
    last parameter comes, a sparse one at once), then those left open: bucket 0 is expected to be ready first.

    ``direct_min_bytes``: a CPU parameter at least this large gets a bucket of its own, marked
    ``direct``: its gradient can be all-reduced where autograd left it, with no copy in or out (``copy_in``).
    Like a sparse one it leaves the open bucket of its kind open and counts towards no cap, so the small
    parameters around large ones (their biases) share one bucket instead of one each between them: one
    all-reduce call each (~0.5 ms on gloo) saved, and where a direct parameter would be last, the bucket
    after it keeps it direct (the 10.5M MLP's first layer: 8 MB not copied in and back). The last bucket is never
    direct (it carries the status flag in a spare element): a direct parameter that would be last joins
    the bucket before it where that one had not reached its cap (torch's rule would have put it there),
    or stays a plain bucket of its own.

    ``sparse[i]``: parameter ``i`` gets sparse gradients (torch's ``expect_sparse_gradient``, an
    ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``): it gets a bucket of its own, as in
    torch's assignment, which leaves the open bucket of its kind open and counts towards no cap. Such a
    bucket has no flat buffer (``numel`` 0): its gradient is all-reduced as the sparse tensor it is.
    """
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {bucket_cap_bytes}")
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"order must be a permutation of range({len(params)}), got {list(order)[:10]}...")
    caps = (
        list(bucket_caps_bytes) if bucket_caps_bytes else [min(first_bucket_bytes, bucket_cap_bytes), bucket_cap_bytes]
    )
    open_buckets: dict[tuple, tuple[BucketPlan | None, int, int]] = {}  # key -> (plan, nbytes, how many closed before)
    closed: list[BucketPlan] = []
    full: set[int] = set()  # ids of plans closed because they reached their cap
    for index in order:
        p = params[index]
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        plan, used, n_closed = open_buckets.get(key, (None, 0, 0))
        if sparse is not None and sparse[index]:
            closed.append(BucketPlan([index], [0], 0, p.dtype, p.device, sparse=True))
            continue
        if direct_min_bytes is not None and nbytes >= direct_min_bytes and p.device.type == "cpu":
            closed.append(BucketPlan([index], [0], p.numel(), p.dtype, p.device, direct=True))
            continue
        if plan is None:
            plan = BucketPlan([], dtype=p.dtype, device=p.device)
        plan.offsets.append(plan.numel)
        plan.param_indices.append(index)
        plan.numel += p.numel()
        used += nbytes
        if used >= caps[min(n_closed, len(caps) - 1)]:
            closed.append(plan)
            full.add(id(plan))
            open_buckets[key] = (None, 0, n_closed + 1)
        else:
            open_buckets[key] = (plan, used, n_closed)
    # Numbered as torch's rebuilt layout: in the order they closed (each when its last parameter came; a
    # sparse parameter's at once), then the ones left open, by their last parameter's place in ``order``.
    position = {index: pos for pos, index in enumerate(order)}
    left_open = [plan for plan, _, _ in open_buckets.values() if plan is not None and plan.param_indices]
    plans = closed + sorted(left_open, key=lambda plan: position[plan.param_indices[-1]])
    if plans and plans[-1].direct:
        last = plans[-1]
        last.direct = False
        before = plans[-2] if len(plans) > 1 else None
        if (
            before is not None
            and not before.direct
            and not before.sparse
            and (before.dtype, before.device) == (last.dtype, last.device)
            and id(before) not in full
        ):
            before.offsets.append(before.numel)
            before.param_indices.append(last.param_indices[0])
            before.numel += last.numel
            plans.pop()
    return plans
