"""The collectives of a backward: how a bucket is issued, and the end of backward's, written once.

``issue_bucket`` is one bucket's collective (the plain all-reduce, a comm hook, the fused compress hook, a
sparse all-reduce), launched in index order by ``launch_order``.

A training rank (``Reducer._finalize_backward``) and a joined rank standing in for one backward
(``Reducer.shadow_backward``, under ``join``) must issue the same collectives in the same order, or they
pair up wrongly and hang. So both call ``finish_collectives``: the buckets still held back launch (in
index order); the status exchange, where this backward needs one, is launched right behind them so it
hides behind their waits; the waits; the non-finite agreement; the status read; and, where any rank
missed a gradient, the gather that names them. What differs between the two callers is only data (a
joined rank's buckets hold zeros, it has no gradient missing and used none), never a collective.
``tests/test_schedule.py`` records both ranks' collectives in every mode and compares them. Of a step's three
files (``wrapper``: the forward; ``reducer``: the backward around them), this one holds its collectives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.collectives.clean import all_reduce_sum_clean, launch_clean
from lockstep.collectives.hierarchical import HierarchicalAllReduce
from lockstep.ddp.errors import raise_missing_gradients
from lockstep.ddp.grad_bucket import GradBucket
from lockstep.ddp.observe import Observer
from lockstep.ddp.reducer_state import Bucket, Status, UsageTracker
from lockstep.ddp.step import VIEW, Backward

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


def issue_bucket(bucket: Bucket, step: Backward, num_buckets: int, group: dist.ProcessGroup, comm_hook: CommHook | None,
                 comm_hook_state: Any, hierarchy: HierarchicalAllReduce | None = None) -> Any:
    """Launch ``bucket``'s collective as ``step.plan`` says; return its work (a ``dist.Work`` or a Future).

    ``hierarchy``: the plain all-reduce of a dense bucket goes through it (inside the nodes, then across); a comm
    hook, the fused compress hook and a sparse bucket keep the flat ``group``."""
    plan = step.plan
    # The NaN check first, where it must see the local gradients (a called or fused hook's)
    divided = plan.nonfinite is not None and plan.nonfinite.check_bucket(bucket, plan.divisor, plan.hooked)
    last = bucket.index == num_buckets - 1
    if last:  # the spare element: every rank's flag is summed there (where no hook is called: ``flag_apart``)
        # fill_ with a Python number launches a kernel; ``buffer[-1] = number`` copies a host scalar in, which on
        # CUDA is a synchronizing copy every backward (tests/test_cuda.py's sync check)
        bucket.buffer[-1:].fill_(float(step.missing_flag))
    if plan.fused is not None:
        return plan.fused.launch(bucket, last, group)
    if comm_hook is not None:
        work = launch_clean(comm_hook, comm_hook_state, GradBucket(bucket, num_buckets))
        if not isinstance(work, torch._C.Future):  # torch.futures.Future and the C++ futures of get_future()
            raise TypeError(
                f"comm hook {getattr(comm_hook, '__name__', comm_hook)!r} must return a "
                f"torch.futures.Future, got {type(work).__name__}"
            )
        return work
    if bucket.sparse is not None:  # a sparse bucket, divided already (``copy_in``); its flag travels apart
        return all_reduce_sum_clean(bucket.sparse, group)
    if plan.mode == VIEW and plan.divisor != 1 and not divided:
        bucket.flat.div_(plan.divisor)  # one pass per bucket instead of one call per parameter
    if bucket.direct is not None:  # the gradient itself (``copy_in``; never the last bucket)
        tensor = bucket.direct
    elif last:
        tensor = bucket.buffer  # with its spare element, and the non-finite count scaled apart from the flag
        if plan.nonfinite is not None:
            plan.nonfinite.add_flag(bucket.buffer)
    else:
        tensor = bucket.flat  # the gradients only, as a direct bucket sends on a rank that went direct
    if hierarchy is not None and tensor.is_contiguous():  # its threads issue the stages in this launch order
        return hierarchy.submit(tensor)
    return all_reduce_sum_clean(tensor, group)


def finish_collectives(
    step: Backward,
    buckets: Sequence[Bucket],
    usage: UsageTracker,
    group: dist.ProcessGroup,
    missing: list[int],
    *,
    joined: bool,
    copy_each: bool,
    observer: Observer | None,
    futures: Sequence[torch.futures.Future],
    names: Sequence[str],
    explain: Callable[[list[int]], str] | None,
) -> tuple[Status, float]:
    """Issue and finish the rest of this backward's collectives; return the agreed status and the seconds waited.

    ``missing``: the parameters this rank marked without a gradient (the flag is already in ``step``);
    ``joined``: a joined rank's shadow (zeros, nothing used). ``copy_each``: each bucket's averages go into
    its gradients right after its wait (``copy_back.wait_buckets``). ``futures``: a buffer comm hook's, waited
    for after the buckets. Raises the missing-gradient error on every rank alike, the joined one included.
    """
    plan = step.plan
    step.order.drain()  # every bucket launched, in index order; a hooked one after the previous is done
    # Every collective of this backward is now issued unless a hook issues some from its callbacks: the status
    # exchange (comm hook, find_unused_parameters) queues behind them and hides behind their waits.
    launched = None if plan.one_in_flight else usage.launch_status(missing, plan.flag_apart, buckets[-1], group, joined)
    waited = plan.strategy.wait(buckets, plan, observer, copy_each)  # the reduction's (``strategy``)
    if futures:
        start = time.perf_counter()
        for future in futures:
            future.wait()
        waited += time.perf_counter() - start
    if plan.nonfinite is not None:
        # raises on every rank alike; ZeRO-2 checked the local gradients before the reduce-scatters, as a hook's
        plan.nonfinite.after_wait(buckets, plan.checks_local, plan.flag_apart)
    status = usage.exchange_status(missing, plan.flag_apart, buckets[-1], group, joined, launched)
    if status.any_missing:
        raise_missing_gradients(status.missing, names, group, usage.static_graph, status.late, explain)
    return status, waited
