"""Gradient memory at backward's peak, in every ``gradient_as_bucket_view`` mode (issue #30).

The peak of a DDP step's gradient memory is the end of backward: every gradient has been handed to the
reducer, no bucket has been copied back yet. This test stands there (a post-accumulate-grad hook of its own
on the parameters of the first layer, the last to get their gradients, registered after DDP's, so it runs
after DDP's hook on the same parameter) and counts, with the garbage collector, every distinct tensor storage
of gradient size that is alive and is not a parameter: the buckets, the ``.grad`` tensors, and whatever the
reducer still holds. It counts bytes, not time, so a loaded machine cannot change it.

The bounds, in units of one model's gradients (G), are torch's reducer's: the buckets (G), plus with copies
(``False``) the ``.grad`` tensors (G). With bucket views (``True``, and lockstep's ``None``) ``.grad`` is its
bucket slot, so G in all, after ``zero_grad()`` (set_to_none) too: torch's reducer re-points ``.grad`` at the
slot in its hook and the gradient autograd made is freed there and then. Before the fix lockstep's buckets
held each such gradient to the end of backward: 2 G at the peak. The fp16 hook's cells have the same bound:
torch's hook allocates each bucket's compressed copy (G/2 in all) per step and frees it after the bucket's
all-reduce, so torch holds the in-flight buckets' copies at this point; lockstep's reducer casts each bucket
into the first half of its own bytes (``ddp/fused_compress``), so it holds none. Before that, it kept every
bucket's copy between steps: G/2 more than the bound.

Limits: a tensor held only from C++ (a work's or a future's tensors) has no Python object for the collector
to find; lockstep keeps every tensor it holds in Python objects, and the end-of-backward figures of
``benchmarks/memory.py`` (RSS) cover the rest.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

MODES = (False, True, None)
VARIANTS = ("plain", "allreduce", "fp16", "unused")
WIDTH, LAYERS = 256, 4  # 4 weights of 256 KB: many small parameters (no direct buckets), G ~ 1 MB


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])


def _held_bytes(exclude: set[int], min_nbytes: int) -> int:
    """Bytes of the distinct live tensor storages of at least ``min_nbytes`` not in ``exclude`` (data pointers)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # TensorBase, the C type: isinstance(obj, torch.Tensor) goes through a Python __instancecheck__ (0.5 s a scan)
        if isinstance(obj, torch._C.TensorBase) and obj.layout == torch.strided and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.nbytes() >= min_nbytes and storage.data_ptr() not in exclude:
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _cases(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import lockstep
    from lockstep.ddp.lifetime import bury

    results = {}
    for variant in VARIANTS:
        for set_to_none in (True, False):
            for view in MODES:
                # The last case's DDP was dropped: its last works (holding its buckets) wait 5 s in lockstep's
                # graveyard for a safe exit (``ddp.lifetime``). Finished on every rank after the barrier: let go.
                gc.collect()  # frees it (its reducer sits in reference cycles), which buries its works
                dist.barrier()
                bury((), safe_after_s=0.0)
                torch.manual_seed(0)
                module = _model()
                ddp = lockstep.DistributedDataParallel(module, bucket_cap_mb=0.3, gradient_as_bucket_view=view,
                                                       find_unused_parameters=variant == "unused")
                if variant == "allreduce":
                    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
                elif variant == "fp16":
                    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                params = list(module.parameters())
                weights = [p for p in params if p.dim() == 2]
                grad_bytes = sum(p.numel() * p.element_size() for p in weights)
                # Only numbers in the hook's closure: a parameter held there would keep every case's model alive.
                exclude = {p.untyped_storage().data_ptr() for p in params}
                min_nbytes = weights[-1].numel() * weights[-1].element_size() // 2
                peak = {"bytes": 0, "measure": False}

                def measure(_param, peak=peak, exclude=exclude, min_nbytes=min_nbytes):
                    if peak["measure"]:
                        peak["bytes"] = max(peak["bytes"], _held_bytes(exclude, min_nbytes))

                first = module[0][0]
                # After DDP's own hook on the same parameter: what the reducer keeps of its gradient counts.
                handles = [p.register_post_accumulate_grad_hook(measure) for p in (first.weight, first.bias)]
                opt = torch.optim.SGD(params, lr=0.01)
                x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
                y = torch.randint(0, WIDTH, (4,), generator=torch.Generator().manual_seed(10 + rank))
                for step in range(3):  # the first steps rebuild the buckets; the third is steady state
                    peak["measure"] = step == 2
                    opt.zero_grad(set_to_none=set_to_none)
                    F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                results[(variant, set_to_none, view)] = peak["bytes"] / grad_bytes
                for handle in handles:
                    handle.remove()
                del ddp, module, opt, params, weights, first
    return results


@pytest.fixture(scope="module")
def held():
    return run_ranks(_cases, 2, timeout_s=300)


@pytest.mark.parametrize("view", MODES, ids=lambda v: f"view={v}")
@pytest.mark.parametrize("set_to_none", (True, False), ids=("zero_grad()", "set_to_none=False"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_memory_at_backward_peak(held, variant, set_to_none, view):
    """At most torch's reducer's gradient memory at the end of backward: G of buckets, + G of .grad with copies."""
    bound = (2.0 if view is False else 1.0) + 0.05  # 0.05: biases and the spare elements; the fp16 hook's too
    for rank, results in enumerate(held):
        ratio = results[(variant, set_to_none, view)]
        # It sees what it counts:
        assert ratio >= 0.95, f"rank {rank}: {ratio:.2f} G found: the count misses the buckets"
        assert ratio <= bound, (
            f"rank {rank}, {variant}, zero_grad(set_to_none={set_to_none}), gradient_as_bucket_view={view}: "
            f"{ratio:.2f} models' gradients alive at the end of backward, bound {bound:.2f}"
        )
