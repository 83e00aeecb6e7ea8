"""The reducer's errors that name the cause: a gradient missing on some rank, a gradient arriving twice.

Their texts carry torch's key sentences for the same faults (code and tests match on them), then what
lockstep knows that torch's does not say: the parameters' names on every rank, what changed since
construction (``module_changes``), which DDP option caused a double arrival and its remedy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from lockstep.collectives.clean import launch_clean


def error_for_log(error: BaseException) -> str:
    """An error as torch's DDP logger records it: "<class 'TypeError'>: message"."""
    return f"{type(error)}: {error}"


def twice_message(name: str, marked_unused: bool) -> str:
    """A parameter's gradient arrived when it was already ready in this backward."""
    if marked_unused:
        # find_unused_parameters walks the graph after forward; a reentrant checkpoint's segment is an opaque
        # autograd Function there (its parameters are reached only by the recomputation during backward).
        return (
            f"parameter {name!r} received its gradient in backward after find_unused_parameters=True had marked it "
            "unused (the graph walk after forward did not reach it): Expected to mark a variable ready only once. "
            "This happens with activation checkpointing (torch.utils.checkpoint with use_reentrant=True), which hides "
            "its parameters from that walk: pass static_graph=True instead of find_unused_parameters=True, or use "
            "use_reentrant=False."
        )
    return (
        f"parameter {name!r} received its gradient twice in one backward: Expected to mark a variable ready only "
        "once. This happens with activation checkpointing (torch.utils.checkpoint with use_reentrant=True) when a "
        "module runs in several checkpointed segments: pass static_graph=True to DistributedDataParallel, or use "
        "use_reentrant=False."
    )


def raise_missing_gradients(
    missing: list[int], names: Sequence[str], group, static_graph: bool = False, late: bool = False,
    explain: Callable[[list[int]], str] | None = None,
) -> None:
    """Every rank calls this together: gather who missed what, raise the same error everywhere.

    ``explain(missing)``: this rank's account of why (``module_changes``: a parameter replaced or frozen
    after the wrapper was built), gathered with the indices so every rank's error carries every rank's.

    The text carries torch's key sentences for the same fault, so code and tests that match on
    torch's message keep working; lockstep raises it at the end of the backward that missed the
    gradients (on every rank) where torch raises at the next forward.
    """
    mine = sorted(missing)  # registration order reads best
    gathered: list = [None] * dist.get_world_size(group)
    why = explain(mine) if explain is not None and mine else ""
    launch_clean(dist.all_gather_object, gathered, (dist.get_rank(), mine, why), group=group)
    parts: list[str] = []
    indices: list[str] = []
    causes: dict[str, list[str]] = {}
    for rank, ranks_missing, ranks_why in gathered:
        if ranks_why:
            causes.setdefault(ranks_why, []).append(str(rank))  # ranks that changed alike are named together
        if ranks_missing:
            shown = ", ".join(repr(names[i]) for i in ranks_missing[:20])
            parts.append(f"rank {rank}: {shown}{' ...' if len(ranks_missing) > 20 else ''}")
            indices.append(
                f"Parameter indices which did not receive grad for rank {rank}: {' '.join(map(str, ranks_missing))}"
            )
    if static_graph:
        cause = (
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your training graph has changed in this iteration, e.g., one parameter is used in first "
            "iteration, but then got unused in the second iteration. this is not compatible with static_graph set "
            "to True.\n" + "\n".join(indices)
        )
    else:
        cause = (
            "Expected to have finished reduction in the prior iteration before starting a new one. This error "
            "indicates that your module has parameters that were not used in producing loss. You can enable unused "
            "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
            "`torch.nn.parallel.DistributedDataParallel` (the unused set may change each iteration), or "
            "static_graph=True (the same set every iteration), and by making sure all `forward` function outputs "
            "participate in calculating loss.\n" + "\n".join(indices)
        )
    when = (
        "the previous backward (on CUDA the flag is read one backward late: no host sync)" if late else "this backward"
    )
    changed = "".join(
        f" On rank{'s' if len(r) > 1 else ''} {', '.join(r)}, parameters were {why}." for why, r in causes.items()
    )
    raise RuntimeError(
        f"DistributedDataParallel: parameters received no gradient in {when}, so the ranks could not "
        f"average them ({'; '.join(parts)}).{changed} {cause}"
    )
