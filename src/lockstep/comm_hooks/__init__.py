"""Communication hooks for DistributedDataParallel: averaging, fp16/bf16 compression, PowerSGD, and chaining.

A hook follows torch's contract, so it runs on lockstep's DDP and on
``torch.nn.parallel.DistributedDataParallel`` alike: ``hook(state, bucket)``
gets a bucket whose ``buffer()`` is the flat 1-D tensor of its local (not yet
averaged) gradients and returns a ``torch.futures.Future`` of the averaged
buffer. ``state`` is a process group, ``None`` for the default group, or a
state object with a ``process_group`` attribute (``PowerSGDState``).

The one idea beyond torch (which allows one hook per model): a *stage* is a
function from a hook to a hook. Stages wrap whatever sits inside them, so they
compose, and ``chain(stage_1, ..., stage_k, hook)`` reads outermost first::

    model.register_comm_hook(None, chain(bf16_compress, allreduce_hook(algorithm="ring")))
    model.register_comm_hook(PowerSGDState(None, 2), chain(fp16_compress, powersgd_hook))
    model.register_comm_hook(None, chain(ErrorFeedback(), bf16_compress, allreduce_hook))

``fp16_compress`` / ``bf16_compress`` cast the buffer, hand the inner hook a
bucket whose ``buffer()`` and ``gradients()`` are the compressed tensor, and
cast its averaged result back into the original buffer; ``ErrorFeedback()``
remembers what the inner hook lost locally and adds it to the next step's
gradients. Write a stage of your own with the ``@stage`` decorator. Every hook
here averages by dividing first and summing second, as torch's hooks do, so
``fp16_compress_hook = chain(fp16_compress, allreduce_hook)`` is torch's fp16
hook bit for bit. A hook that issues several collectives must issue them in the
same order on every rank: ours do so from the hook call itself, never from a
Future callback, whose timing differs between ranks. They say so
(``collectives_up_front``; the stages pass it on from their inner hook), and DDP
then keeps every bucket in flight, overlapping backward; for an undeclared hook
it keeps one bucket in flight at a time, which is safe for any hook. A hook that
only averages a half-precision copy of the bucket may say so too
(``averages_in(dtype, hook)``; ``fp16_compress_hook`` and ``bf16_compress_hook``
do, and torch's two compress hooks are recognised): lockstep's DDP then runs that
average itself, with the same bits and less work (``lockstep.ddp.fused_compress``).
"""

# No `from __future__ import annotations` in this package: torch's DDP compares a hook's annotations
# with dist.GradBucket and Future[torch.Tensor] by value, and a postponed annotation is a string.
from lockstep.comm_hooks.base import (
    BucketLike,
    Future,
    Hook,
    Stage,
    averages_in,
    collectives_up_front,
    compressed_average_dtype,
    issues_collectives_up_front,
)
from lockstep.comm_hooks.powersgd import PowerSGDState, powersgd_hook
from lockstep.comm_hooks.stages import (
    ErrorFeedback,
    allreduce_hook,
    bf16_compress,
    bf16_compress_hook,
    chain,
    fp16_compress,
    fp16_compress_hook,
    stage,
)

__all__ = [
    "BucketLike", "ErrorFeedback", "Future", "Hook", "PowerSGDState", "Stage", "allreduce_hook", "averages_in",
    "bf16_compress", "bf16_compress_hook", "chain", "collectives_up_front", "compressed_average_dtype", "fp16_compress",
    "fp16_compress_hook",
    "issues_collectives_up_front", "powersgd_hook", "stage",
]
