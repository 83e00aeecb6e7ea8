"""torch's ``_apply_optimizer_in_backward`` under DDP: each parameter's optimizer steps on the average.

``torch.distributed.optim._apply_optimizer_in_backward`` gives every parameter its own optimizer
(``param._in_backward_optimizers``) and a post-accumulate-grad hook that steps it on the *local*
gradient. Under DDP that hook must go (the step must see the all-reduced gradient), which is what
torch's DDP does at its first forward. lockstep then steps those optimizers when the averages are
back in ``.grad`` at the end of backward, and sets ``.grad`` to None afterwards, as torch does.

Difference from torch, documented: torch steps each bucket's optimizers as soon as that bucket's
all-reduce is done (overlapping the step with the rest of backward on a side stream); lockstep
steps them all after the last bucket. The parameters are the same; only the overlap differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def take_over_optimizers_in_backward(params: Sequence[torch.nn.Parameter]) -> bool:
    """Remove the local-gradient hooks ``_apply_optimizer_in_backward`` put on ``params``; True if any has one."""
    used = [p for p in params if hasattr(p, "_in_backward_optimizers")]
    if not used:
        return False
    try:
        from torch.distributed.optim.apply_optimizer_in_backward import param_to_optim_hook_handle_map
    except ImportError:  # an older torch without the handle map: the hooks stay, and would step twice
        raise RuntimeError(
            "DistributedDataParallel: parameters use _apply_optimizer_in_backward, but this torch does not expose "
            "its hook handles (torch.distributed.optim.apply_optimizer_in_backward.param_to_optim_hook_handle_map)"
        ) from None
    for p in used:
        for handle in param_to_optim_hook_handle_map.get(p, []):
            handle.remove()
    return True


def step_optimizers_in_backward(params: Sequence[torch.nn.Parameter]) -> None:
    """Step every in-backward optimizer on the averaged gradient, then drop the gradient (as torch)."""
    for p in params:
        optimizers = getattr(p, "_in_backward_optimizers", None)
        if optimizers:
            for optimizer in optimizers:
                optimizer.step()
            p.grad = None
