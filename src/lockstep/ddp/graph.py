"""What the reducer learns from the autograd graph: which parameters a forward used, and when backward ends.

``reachable_params`` walks the graph from a forward's outputs to the parameters'
AccumulateGrad nodes (no clone of the outputs, unlike torch's fix that doubled
memory, PyTorch #74115). ``on_backward_start`` puts a pre-hook on the outputs'
``grad_fn`` nodes, which run in the *outer* backward; the end-of-backward callback
is queued there, so it fires after the whole backward even when activation
checkpointing (``use_reentrant=True``) runs nested backwards, whose own graph tasks
would otherwise end first. Unlike torch's ``_DDPSink`` nothing wraps the outputs.

That pre-hook also runs in a ``torch.autograd.grad`` call through the outputs (a gradient penalty: WGAN-GP,
StyleGAN's R1; an adversarial attack), which accumulates into no parameter's ``.grad``. As torch's reducer,
which acts only when a parameter's hook fires, lockstep's must then neither end the step (the end callback
finds no gradient and leaves the reducer expecting this forward's backward) nor launch anything: the unused
parameters (find_unused_parameters, static_graph) are marked at backward start only where
``backward_accumulates`` says this graph task will run some parameter's AccumulateGrad node, else at the first
hook, if one fires.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

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
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # as torch's _find_tensors
        for field in dataclasses.fields(obj):
            _output_tensors(getattr(obj, field.name), out)


def grad_accumulators(params: Sequence[torch.Tensor]) -> list[Any]:
    """Each parameter's AccumulateGrad node (kept alive here, so autograd reuses the same node in every graph)."""
    with torch.enable_grad():
        return [p.expand_as(p).grad_fn.next_functions[0][0] for p in params]  # type: ignore[union-attr]  # a view of a leaf that requires grad has one


def backward_accumulates(accumulators: list[Any]) -> bool:
    """Inside a backward: will this graph task accumulate into at least one of these parameters' ``.grad``?

    False for ``torch.autograd.grad`` (and ``backward(inputs=...)`` naming none of them). One autograd query on
    the common path (the last parameter, usually the first to get its gradient: ~2 us), all of them otherwise.
    """
    will_run = torch._C._will_engine_execute_node
    return will_run(accumulators[-1]) or any(will_run(node) for node in accumulators)


def output_tensors(outputs: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output (tensor, tuple, list, dict, dataclass, nested)."""
    found: list[torch.Tensor] = []
    _output_tensors(outputs, found)
    return found


def reachable_params(outputs: Any, index_of: dict[int, int]) -> tuple[set[int], int]:
    """Indices (via ``index_of``: id(param) -> index) of parameters the outputs' graph leads to, and the
    number of graph nodes visited.

    Costs one Python visit per graph node, each forward (only with find_unused_parameters).
    """
    tensors = output_tensors(outputs)
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    leaves = [t for t in tensors if t.grad_fn is None and t.requires_grad]
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
    return used, len(seen)


def on_backward_start(outputs: Any, callback: Callable[[Any], None]) -> int:
    """Call ``callback(grad_outputs)`` when backward first reaches a node that produced ``outputs``.

    A pre-hook on each output's ``grad_fn``: it runs in the graph task of the user's own backward,
    so a callback queued from it runs after that whole backward. Nothing is wrapped: the outputs
    stay the module's own tensors (in-place ops on them keep working, no copy is made). Returns
    the number of nodes hooked (0 when no output has a graph).
    """
    nodes = {}
    for t in (outputs,) if isinstance(outputs, torch.Tensor) else output_tensors(outputs):  # a loss, logits: one
        if t.grad_fn is not None:
            nodes[id(t.grad_fn)] = t.grad_fn
    for node in nodes.values():
        node.register_prehook(callback)  # returns None: the gradients flow on unchanged
    return len(nodes)
