"""Collectives launched inside backward without the Python object that backward puts in thread-local state.

torch >= 2.13's ``_engine_run_backward`` stashes a ``contextvars`` context in torch's thread-local
state for the length of a backward. Every collective launched then (a bucket's all-reduce from a
gradient hook, the status exchange from the end-of-backward callback, a comm hook's collectives)
captures that state into its ``Work``, so the work holds a Python object, and whichever thread
drops the work last must take the GIL to free it. gloo's worker thread lets go of a work a moment
*after* it marked it complete; if that is the last reference and the interpreter is finalising, the
worker is made to exit inside a noexcept destructor and the process aborts ("terminate called without
an active exception"; a core showed ``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``decref`` ->
``take_gil`` -> ``pthread_exit`` in ``ProcessGroupGloo::runLoop`` while the main thread was in
``Py_FinalizeEx``). Launched through ``launch_clean`` the work captures no Python object, so freeing
it needs no GIL, whichever thread does it, whenever. torch's DDP launches from C++ with the object
in place, and can abort so at exit (``ddp.lifetime``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_TLS_KEY = "context"  # what torch's _engine_run_backward stashes (torch >= 2.13); absent before
_is_key_in_tls = getattr(torch._C, "_is_key_in_tls", None)
_remove_obj_from_tls = getattr(torch._C, "_remove_obj_from_tls", None)
_HAS_ASYNC_OP = hasattr(dist.AllreduceOptions(), "asyncOp")  # torch >= 2.7
_T = TypeVar("_T")
# What pybind makes of ReduceOp.SUM when it is assigned to opts.reduceOp: made once, copied into each opts.
_SUM = dist.ReduceOp(dist.ReduceOp.SUM)


def launch_clean(launch: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``launch(*args, **kwargs)`` (a collective inside backward) without the Python object that backward
    stashes in torch's thread-local state, so the work does not capture it: freeing such a work then
    needs no GIL, whichever thread lets go of it last. Four C calls (~1 us) when the key is there, one when not.
    """
    if _is_key_in_tls is None or _remove_obj_from_tls is None or not _is_key_in_tls(_TLS_KEY):
        return launch(*args, **kwargs)
    stashed = torch._C._get_obj_in_tls(_TLS_KEY)
    _remove_obj_from_tls(_TLS_KEY)
    try:
        return launch(*args, **kwargs)
    finally:
        torch._C._stash_obj_in_tls(_TLS_KEY, stashed)


def all_reduce_sum_clean(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work | None:
    """``launch_clean(dist.all_reduce, tensor, group=group, async_op=True)``, straight to the group's C++ method.

    ``dist.all_reduce`` spends ~50-100 us of Python per call on checks that cannot fail for a reducer's own
    buffers (a plain dense real tensor on a group this rank belongs to, outside any coalescing manager);
    torch's reducer calls the group directly too. Anything else (a tensor subclass, complex values, no
    group object) takes ``dist.all_reduce``.
    """
    if group is None or type(tensor) is not torch.Tensor or tensor.is_complex():
        return launch_clean(dist.all_reduce, tensor, group=group, async_op=True)
    opts = dist.AllreduceOptions()
    opts.reduceOp = _SUM
    if _HAS_ASYNC_OP:
        opts.asyncOp = True  # as dist.all_reduce(async_op=True) sets it (NCCL: the work runs on its own stream)
    return launch_clean(group.allreduce, [tensor], opts)
