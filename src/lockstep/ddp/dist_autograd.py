"""DDP under torch's distributed autograd (RPC): gradients that land in a context, not in ``.grad``.

``torch.distributed.autograd.backward(context_id, [loss])`` runs a backward whose leaf gradients go into the
context (``dist_autograd.get_gradients``): no parameter's AccumulateGrad runs, ``.grad`` is left alone, and the
post-accumulate-grad hooks the reducer listens on never fire. torch's C++ reducer reads and writes the
context's gradient instead (torch's ``ddp_under_dist_autograd_test.py``; the tutorial "Combining Distributed
DataParallel with Distributed RPC Framework"). Without this module lockstep's DDP left those gradients
un-averaged, silently.

Here a synchronised forward run inside a ``dist_autograd.context()`` hooks each parameter's AccumulateGrad
node (the distributed engine still runs a node's post hooks after it puts the gradient in the context).
For the length of that backward ``param.grad`` *is* the context's gradient, so the reducer's usual path
averages it; at the end of the backward the average is written into the context's tensor where it is not
there already, and every parameter's ``.grad`` is put back as it was before the backward.

Costs: nothing where RPC is not initialised (one C call per synchronised forward); under a context, one
``get_gradients`` (a dict of the context's gradients) per parameter per backward. Not covered (as in torch,
whose reducer asserts there): ``find_unused_parameters`` under distributed autograd, where an unused
parameter's bucket slot is filled from its local ``.grad``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch


def current_context_id() -> int | None:
    """The distributed-autograd context this thread is in, or None (also where RPC is off or not built)."""
    try:
        from torch.distributed import rpc
        if not rpc.is_available() or not rpc._is_current_rpc_agent_set():
            return None
        from torch.distributed import autograd as dist_autograd
        return dist_autograd._current_context()._context_id()
    except (ImportError, RuntimeError, AttributeError):
        return None  # no context on this thread ("Current thread doesn't have a valid autograd context")


def _agent_check() -> Callable[[], bool]:
    """torch's C check that an RPC agent is running (a C call: the reducer asks it every forward); always False where
    RPC is not built."""
    try:
        from torch.distributed import rpc
        if rpc.is_available():
            return rpc._is_current_rpc_agent_set
    except (ImportError, AttributeError):
        pass
    return functools.partial(bool, False)


rpc_agent_set = _agent_check()


class BridgedReducer(Protocol):
    """What the bridge asks of the reducer it feeds."""

    params: list[torch.nn.Parameter]
    expect_hooks: bool

    def is_ready(self, index: int) -> bool: ...
    def on_grad(self, index: int, param: torch.Tensor) -> None: ...


class DistAutogradBridge:
    """One reducer's link to the distributed-autograd context of its current forward (see the module)."""

    def __init__(self, reducer: BridgedReducer) -> None:
        self._reducer = weakref.ref(reducer)  # held by the reducer; the node hooks hold this bridge
        self.context_id: int | None = None
        self._handles: list = []
        self._swapped: list[tuple[int, torch.Tensor]] = []  # (parameter index, the context's gradient)
        self.saved: list | None = None  # every parameter's .grad before this backward

    def at_forward(self, accumulators: Sequence[Any]) -> None:
        """A synchronised forward: note its context (None outside one); hook the parameters' AccumulateGrad
        nodes (``accumulators``, in parameter order) the first time."""
        self.context_id = current_context_id()
        if self.context_id is not None and not self._handles:
            self._handles = [node.register_hook(self._node_hook(i)) for i, node in enumerate(accumulators)]

    def _node_hook(self, index: int):
        def hook(grad_inputs, grad_outputs):
            reducer = self._reducer()
            if reducer is None or self.context_id is None or not reducer.expect_hooks:
                return
            if reducer.is_ready(index):
                return  # a local backward: its tensor hook ran first
            param = reducer.params[index]
            from torch.distributed import autograd as dist_autograd
            try:
                grad = dist_autograd.get_gradients(self.context_id).get(param)
            except RuntimeError:
                return  # the context was released
            if grad is None:
                return  # a local backward inside the context (its tensor hook ran, or will mark it)
            if self.saved is None:  # this backward's first: .grad of every parameter out of the way
                self.saved = [p.grad for p in reducer.params]
                for p in reducer.params:
                    p.grad = None
            param.grad = grad
            self._swapped.append((index, grad))
            reducer.on_grad(index, param)

        return hook

    def at_end_of_backward(self, params: Sequence[torch.nn.Parameter]) -> None:
        """After the averages are in ``.grad``: into the context's tensors, and ``.grad`` back as it was."""
        if self.saved is None:
            return
        swapped, saved = self._swapped, self.saved
        self._swapped, self.saved = [], None
        for index, grad in swapped:
            average = params[index].grad
            if average is not None and average is not grad:  # a bucket view or a clone (``copy_back``)
                grad.copy_(average)
        for p, g in zip(params, saved):
            p.grad = g

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
