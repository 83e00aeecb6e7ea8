"""The part of torch's private DDP surface that libraries and torch's own tests reach, in lockstep's terms.

lockstep's ``DistributedDataParallel`` subclasses ``torch.nn.parallel.DistributedDataParallel``
so that ``isinstance(m, torch.nn.parallel.DistributedDataParallel)`` holds (Accelerate unwraps
and syncs by it, Lightning registers hooks and tears down by it), but it never runs torch's
``__init__``: there is no C++ reducer and no C++ logger behind it. So every method it would
inherit from torch's class is either given lockstep's meaning here (``WrapperSurface``; torch's ``Reducer``
methods that libraries call are the lockstep ``Reducer``'s own) or closed (``close_inherited``): reading it raises an
AttributeError that names the method and says why, instead of a confusing failure deep inside torch's code.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.ddp.args import STATIC_WITH_FIND_UNUSED
from lockstep.ddp.reducer import Reducer
from lockstep.ddp.replicas import broadcast_coalesced, named_syncable_buffers

# torch's methods that work unchanged on lockstep's wrapper (they read only attributes it has).
INHERITED_AS_IS = frozenset({
    "_abc_impl", "_active_ddp_module", "_get_active_ddp_module", "_inside_ddp_forward", "_check_comm_hook",
    "_set_ddp_sink_clone", "_distributed_rank", "train",
})

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch's broadcast_bucket_size


class _Closed:
    """A class attribute that hides one of torch's inherited DDP methods behind a clear AttributeError."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Any:
        raise AttributeError(closed_message(self.name))


def closed_message(name: str) -> str:
    return (
        f"lockstep's DistributedDataParallel has no {name!r}: torch's DistributedDataParallel.{name} drives "
        "torch's C++ reducer, which lockstep replaces (docs/integrations.md, section \"torch's private surface\")"
    )


def close_inherited(cls: type, torch_cls: type) -> None:
    """Close every attribute of ``torch_cls`` that ``cls`` neither defines nor inherits as is."""
    for name in vars(torch_cls):
        if name.startswith("__") or name in INHERITED_AS_IS:
            continue
        if not any(name in vars(klass) for klass in cls.__mro__[: cls.__mro__.index(torch_cls)]):
            setattr(cls, name, _Closed(name))


class _Wrapper(Protocol):
    """What ``WrapperSurface``'s methods read of the wrapper they are mixed into (``DistributedDataParallel``).

    Read-only members are properties (the wrapper sets them in its ``__init__``); the two that a method here assigns
    (``_set_static_graph``, the ``broadcast_buffers`` setter) are attributes.
    """

    @property
    def reducer(self) -> TorchReducer: ...
    @property
    def module(self) -> torch.nn.Module: ...
    @property
    def process_group(self) -> dist.ProcessGroup: ...
    @property
    def device_ids(self) -> list[int] | None: ...
    @property
    def output_device(self) -> int | None: ...
    @property
    def parameters_to_ignore(self) -> set[str]: ...
    @property
    def bucket_bytes_cap(self) -> int: ...
    @property
    def _bucket_caps_bytes(self) -> list[int] | None: ...
    @property
    def find_unused_parameters(self) -> bool: ...
    @property
    def gradient_as_bucket_view(self) -> bool | None: ...
    @property
    def require_forward_param_sync(self) -> bool: ...
    @property
    def _sync_buffers(self) -> list[torch.Tensor]: ...
    @property
    def modules_buffers(self) -> list[torch.Tensor]: ...
    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]: ...
    @property
    def _buffer_hook(self) -> tuple[Any, Any, bool] | None: ...

    forward_sync_buffers: bool
    static_graph: bool

    def _log_and_throw(self, error: BaseException) -> None: ...
    def register_comm_hook(self, state: Any, hook: Any) -> None: ...


class WrapperSurface:
    """torch's private wrapper methods that Lightning, Accelerate and torch's tests call, with lockstep's meaning."""

    broadcast_bucket_size = BROADCAST_BUCKET_BYTES
    _buffer_hook: tuple[Any, Any, bool] | None = None  # (hook, state, before forward?): _register_buffer_comm_hook

    def _log_and_throw(self: _Wrapper, error: BaseException) -> None:
        """Raise ``error``, noted first as torch's DDP notes an error it raises after construction: its logging
        data then carries ``has_error`` and ``error`` (``error_for_log``). Noted on the reducer, where a
        backward's error goes too, so the last one is reported."""
        self.reducer.log_error(error)
        raise error

    @property
    def broadcast_buffers(self) -> bool:
        """The old name of ``forward_sync_buffers`` (torch 2.13 keeps it as this property)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: torch.nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """As torch's: name parameters and buffers that DDP must neither synchronise nor reduce; each named tensor
        is also marked ``_ddp_ignored`` (what torch.compile's DDP optimizer and ``_get_data_parallel_params`` read)."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        names = set(params_and_buffers_to_ignore)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in names:
                tensor._ddp_ignored = True  # type: ignore[attr-defined]  # torch's own marker, set on the tensor object

    @staticmethod
    def _get_data_parallel_params(module: torch.nn.Module, named_params: bool = False) -> Any:
        """As torch's: a generator of ``module``'s parameters (``(name, parameter)`` with ``named_params``) that DDP
        manages, i.e. those not marked ``_ddp_ignored`` by ``_set_params_and_buffers_to_ignore_for_model``."""
        for item in module.named_parameters() if named_params else module.parameters():
            if not hasattr(item[1] if named_params else item, "_ddp_ignored"):
                yield item

    @property
    def modules_buffers(self: _Wrapper) -> list[torch.Tensor]:
        """The buffers a synchronised forward broadcasts (torch's attribute of the same name)."""
        return self._sync_buffers

    @property
    def bucket_bytes_cap_list(self: _Wrapper) -> list[int]:
        """Per-bucket caps in bytes from ``bucket_cap_mb_list``; ``[]`` without one (torch's attribute)."""
        return list(self._bucket_caps_bytes or [])

    def will_sync_module_buffers(self: _Wrapper) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.modules_buffers) > 0

    def _check_default_group(self: _Wrapper) -> None:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That is, "
                "when you have called init_process_group and have not passed process_group argument to DDP constructor"
            )

    def _set_static_graph(self: _Wrapper) -> None:
        """Turn on ``static_graph`` after construction, before the first backward (as torch's private API, with
        its two warnings: already static, and find_unused_parameters=True made redundant)."""
        if self.static_graph:
            warnings.warn(
                "static_graph is already True for this DistributedDataParallel: nothing to set again.", stacklevel=2
            )
            return
        try:
            self.reducer._set_static_graph()
        except RuntimeError as error:
            self._log_and_throw(error)
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(STATIC_WITH_FIND_UNUSED, UserWarning, stacklevel=2)

    def _check_reducer_finalized(self: _Wrapper) -> None:
        self.reducer._check_reducer_finalized()

    def _remove_autograd_hooks(self: _Wrapper) -> None:
        self.reducer._remove_autograd_hooks()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self._logging_sample_rate = sample_rate  # lockstep keeps no sampled runtime stats; accepted for scripts

    def _register_builtin_comm_hook(self: _Wrapper, comm_hook_type: Any) -> None:
        """torch's ``dist.BuiltinCommHookType`` ALLREDUCE / FP16_COMPRESS, as lockstep's equivalent hooks."""
        from lockstep.comm_hooks import allreduce_hook, fp16_compress_hook

        hooks = {"ALLREDUCE": allreduce_hook, "FP16_COMPRESS": fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type)).split(".")[-1]
        if name not in hooks:
            raise ValueError(f"_register_builtin_comm_hook: unknown comm hook type {comm_hook_type!r}")
        self.register_comm_hook(self.process_group, hooks[name])
        self.reducer.name_comm_hook(str(comm_hook_type))  # torch logs a built-in hook by its type, not a function

    def _register_buffer_comm_hook(self, state: Any, hook: Any, comm_hook_location: Any = None) -> None:
        """torch's buffer comm hook: ``hook(state, {name: buffer})`` replaces the buffers' broadcast.

        It runs where the broadcast would (a forward after a synchronised one), before the module's
        forward with ``_BufferCommHookLocation.PRE_FORWARD`` or after it (POST_FORWARD, the default).
        Futures it returns are waited for at the end of the next backward, as torch's.
        """
        if not callable(hook):
            raise AssertionError(f"hook must be callable, got {type(hook).__name__}")
        pre = getattr(comm_hook_location, "name", "POST_FORWARD") == "PRE_FORWARD"
        self._buffer_hook = (hook, state, pre)

    @property
    def named_module_buffers(self: _Wrapper) -> dict[str, torch.Tensor]:
        return named_syncable_buffers(self.module, self.parameters_to_ignore)

    def _default_broadcast_coalesced(
        self: _Wrapper, bufs: Any = None, bucket_size: Any = None, authoritative_rank: int = 0
    ) -> None:
        """Broadcast ``bufs`` (default: the module's buffers) from ``authoritative_rank``; the chunk size is
        lockstep's."""
        broadcast_coalesced(self._sync_buffers if bufs is None else list(bufs), self.process_group, authoritative_rank)

    def _run_buffer_hook(self: _Wrapper) -> None:
        assert self._buffer_hook is not None  # the wrapper calls this only once a hook is registered
        hook, state, _ = self._buffer_hook
        buffers = self.named_module_buffers
        if not buffers:
            return  # as torch: no buffers, no hook call
        futures = hook(state, buffers)
        if futures is not None:
            self.reducer.post_backward_futures.extend(futures)

    def _get_ddp_logging_data(self: _Wrapper) -> dict:
        """The keys of torch's logging data that have a meaning here (Lightning reads it at teardown)."""
        reducer = self.reducer
        # torch's logger has no "comm_hook" entry until a hook is registered: a Python hook's __qualname__,
        # a built-in one's type (``_register_builtin_comm_hook``).
        errors = {} if reducer.logged_error is None else {"has_error": 1, "error": reducer.logged_error}
        hook = {} if reducer.comm_hook is None else {"comm_hook": reducer.comm_hook_name or getattr(
            reducer.comm_hook, "__qualname__", type(reducer.comm_hook).__name__)}
        return {**hook, **errors,
            "module_name": type(self.module).__name__,
            "device_ids": "" if self.device_ids is None else ", ".join(map(str, self.device_ids)),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            # As torch: the argument (0 when not passed); what lockstep does is "grads_alias_buckets".
            "gradient_as_bucket_view": int(bool(self.gradient_as_bucket_view)),
            "static_graph": int(self.static_graph),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.module.modules())),
            "backend_name": dist.get_backend(self.process_group),
            "world_size": dist.get_world_size(self.process_group),
            "rank": dist.get_rank(self.process_group),
            "iteration": reducer.num_syncs,
            "num_buckets_reduced": len(reducer.buckets),
            "bucket_sizes": ", ".join(str(b.plan.numel * b.flat.element_size()) for b in reducer.buckets),
            "has_rebuilt_buckets": int(reducer.buckets_rebuilt),
            "join_uneven_inputs": int(getattr(self, "_join_used", False)),  # set once a join hook was built
            # torch sets this after iterations in which the set of used parameters never changed.
            "can_set_static_graph": 0,
            "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in reducer.params})),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in reducer.params),
            "num_parameter_tensors": len(reducer.params),
            "lockstep": 1,
            "grads_alias_buckets": int(reducer.grad_mode != "copy"),  # .grad is its bucket slot after backward
        }


class TorchReducer(Reducer):
    """The reducer with torch's ``Reducer`` methods that Lightning, Accelerate and torch's tests call on
    ``ddp.reducer``, in lockstep's terms (each through the reducer's own public methods and state)."""

    def _rebuild_buckets(self) -> bool:
        """Rebuild now if one is due; whether it rebuilt (a no-op after lockstep's own forward)."""
        due = self.rebuild_pending
        if due:
            self.rebuild_buckets()
        return due

    def prepare_for_backward(self, outputs: Any) -> None:
        """Make the coming backward synchronised (Accelerate after a ``no_sync`` forward, Lightning's manual
        optimisation). ``outputs`` empty (as both pass it): the used parameters are unknown, so one that gets no
        gradient is unused, not an error. Idempotent after lockstep's own forward."""
        if not self.expect_hooks:
            tensors = (
                [t for t in outputs if isinstance(t, torch.Tensor)] if isinstance(outputs, (list, tuple)) else outputs
            )
            self.after_forward(tensors if tensors else None)

    def _ddp_graph_static(self) -> bool:
        """With find_unused_parameters, False once the unused set differed from the last iteration's."""
        return self.usage.graph_static

    def _delay_all_reduce(self) -> None:
        """A static graph's first-iteration flush: nothing is left to flush here (every bucket is reduced by the end
        of backward), so only a call inside a backward is refused."""
        if self.step is not None:
            raise RuntimeError(
                "Reducer._delay_all_reduce was called while a backward was running; call it after backward returns"
            )

    def _set_static_graph(self) -> None:
        if self.num_syncs > 0 or self.expect_hooks:
            raise RuntimeError(
                "DistributedDataParallel._set_static_graph should be called before training loop starts: this model "
                "already ran a forward/backward. Pass static_graph=True to the constructor, or call it before the "
                "first forward."
            )
        self.use_static_graph()

    def _check_reducer_finalized(self) -> None:
        step = self.step
        if step is not None and (step.hooks_fired or any(any(b.seen) for b in self.buckets)):
            raise RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a new one. The last "
                "backward of this model stopped before every bucket was reduced."
            )

    def _remove_autograd_hooks(self) -> None:
        self.remove_hooks()


def move_to(obj: Any, device: torch.device) -> Any:
    """Inputs onto DDP's device (``device_ids``), through lists, tuples, namedtuples and dicts, as torch's DDP moves
    them."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        moved = [move_to(o, device) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, dict):
        return type(obj)((k, move_to(v, device)) for k, v in obj.items())
    return obj
