"""What the reducer learns from the autograd graph: which parameters a forward used, and when backward ends.

``reachable_params`` walks the graph from a forward's outputs to the parameters'
AccumulateGrad nodes (no clone of the outputs, unlike torch's fix that doubled
memory, PyTorch #74115). ``attach_sink`` passes the outputs through an identity
autograd Function whose backward runs first in the *outer* backward; it queues the
end-of-backward callback there, so that callback fires after the whole backward
even when activation checkpointing (``use_reentrant=True``) runs nested backwards,
whose own graph tasks would otherwise end first.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _output_tensors(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _output_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _output_tensors(o, out)


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output (tensor, tuple, list, dict, nested)."""
    found: list[torch.Tensor] = []
    _output_tensors(outputs, found)
    return found


def reachable_params(outputs: Any, index_of: dict[int, int]) -> set[int]:
    """Indices (via ``index_of``: id(param) -> index) of parameters the outputs' graph leads to.

    Costs one Python visit per graph node, each forward (only with find_unused_parameters).
    """
    stack = [t.grad_fn for t in output_tensors(outputs) if t.grad_fn is not None]
    leaves = [t for t in output_tensors(outputs) if t.grad_fn is None and t.requires_grad]
    used = {index_of[id(t)] for t in leaves if id(t) in index_of}
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their parameter
        if variable is not None and id(variable) in index_of:
            used.add(index_of[id(variable)])
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                stack.append(next_node)
    return used


class _Sink(torch.autograd.Function):
    """Identity on the outputs; its backward (the first node of backward to run) calls ``on_backward``."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *tensors: torch.Tensor):
        ctx.on_backward = on_backward
        return tuple(t.view_as(t) for t in tensors)  # views: no copy of the outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.on_backward()
        return (None, *grads)


def _replace(obj: Any, mapping: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return mapping.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_replace(o, mapping) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, mapping) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _replace(v, mapping)) for k, v in obj.items())
    return obj


def attach_sink(outputs: Any, on_backward: Callable[[], None]) -> Any:
    """Return ``outputs`` with its grad-requiring tensors routed through ``_Sink``; unchanged if there are none."""
    tensors = [t for t in output_tensors(outputs) if t.requires_grad]
    if not tensors:
        return outputs
    routed = _Sink.apply(on_backward, *tensors)
    return _replace(outputs, {id(t): r for t, r in zip(tensors, routed)})
