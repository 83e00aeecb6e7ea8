"""DistributedDataParallel: the module wrapper, a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

Same constructor, same ``.module``, ``no_sync()`` and ``register_comm_hook``, same state_dict keys (``module.``
prefix). The wrapper itself does little: at construction it checks every rank built the same model and copies rank
0's state; each forward decides whether the coming backward is synchronised (not under ``no_sync``, not without
grad) and broadcasts buffers. A step is written in three files: this one (the forward), ``reducer`` (backward start,
the per-parameter hook, the launch, the end of backward) and ``schedule`` (every collective the backward issues);
docs/architecture.md has its call path.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from lockstep.collectives.hierarchical import hierarchy_for
from lockstep.comm_hooks.base import contract_error
from lockstep.ddp import buffer_sync, compiled, diagnose, module_changes
from lockstep.ddp.args import (
    ignored_names,
    produces_sparse_gradient,
    reject_module,
    reject_unsupported,
    resolve_buffer_sync,
    resolve_group,
    warn_like_torch,
)
from lockstep.ddp.compiled import forward_outside_dynamo, skip_lockstep_in_dynamo
from lockstep.ddp.config import DEFAULT_DIRECT_MIN_BYTES, BucketCaps, DiagnosticsOptions
from lockstep.ddp.fused_compress import fused_compression
from lockstep.ddp.graph import on_backward_start
from lockstep.ddp.join import (
    DDPJoinHook,
    backward_sync_round,
    common_rank,
    join_divisor,
    notify_not_joined,
)
from lockstep.ddp.overlap_step import OverlappedOptimizer, OverlappedStep
from lockstep.ddp.pickling import Pickling
from lockstep.ddp.replicas import (
    broadcast_coalesced,
    syncable_buffers,
    verify_params_across_ranks,
)
from lockstep.ddp.step import COPY
from lockstep.ddp.strategy import AllReduce, register_waits
from lockstep.ddp.torch_surface import (
    TorchReducer,
    WrapperSurface,
    close_inherited,
    closed_message,
    move_to,
)
from lockstep.ddp.zero2 import ZeroOptimizer, ZeroShards, check_optimizer_class
from lockstep.diagnostics.progress import observer_for
from lockstep.diagnostics.watchdog import FROM_ENV, resolve_hang_timeout, watch_for_hangs
from lockstep.process_group import admission_pending

_HIERARCHY_KEYWORD = "DistributedDataParallel: hierarchical_all_reduce"  # named in its errors


# torch's class is subclassed for isinstance only; two of lockstep's members differ in type from torch's stubs.
class DistributedDataParallel(Pickling, WrapperSurface, nn.parallel.DistributedDataParallel):  # type: ignore[misc, override]
    """Data parallelism with bucketed all-reduce overlapped with backward.

    Args (as torch's):
        module: the model, already on its device; every rank must build the same one.
        device_ids: ``[device]`` for a single-GPU module (inputs are moved there); None for CPU.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        dim: accepted for compatibility (multi-device scatter is not supported, as in torch 2.x).
        broadcast_buffers: superseded by ``forward_sync_buffers`` (passing it warns, FutureWarning).
        init_sync: check the model across ranks and broadcast rank 0's state at construction (off, and the
            hierarchical all-reduce too, in a process joining a running in-place job: docs/preemptible.md).
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: bucket size in MiB (default 25); the first bucket is 1 MiB in the first step and, after the
            rebuild, only where its early all-reduce can overlap backward (a GPU, or a CPU core the ranks' threads leave
            free; else it has the full cap: class attribute ``small_first_bucket``). ``"auto"`` (or a
            ``lockstep.ddp.autotune.AutoBucketCap``) tries 1, 4, 25, 100 MiB and one bucket over the first ~20 steps and
            keeps the fastest by rank 0's step times (not in torch; see ``autotune``). Left unset, the default goes to
            those trials by itself where every rank's second backward waited on a slow wire (a link between nodes).
        find_unused_parameters: after each forward, walk its graph and mark the parameters it does not reach as ready
            (they contribute their accumulated ``.grad`` or zeros). A parameter used in any micro-batch of a ``no_sync``
            window is synchronised. Costs a graph walk per forward and one small all-reduce per backward.
        check_reduction: deprecated in torch, ignored.
        gradient_as_bucket_view: False (the default): torch's, exactly: the averages are copied back into the local
            gradient tensors. None (lockstep's opt-in; torch's DDP reads it as False): after each synchronised backward
            ``param.grad`` is its slot in the bucket buffer, holding the average, so nothing is copied back: one pass
            over the gradients per step instead of two, and one model's worth of gradient memory less from the end of
            backward to the next ``zero_grad``; the values are the default's bit for bit (the same fused scale-and-copy
            in); see "Differences" below for what aliasing means. True: torch's bucket views: with
            ``zero_grad(set_to_none=True)`` the fresh gradient is copied in once per step and the bucket divided at
            launch; ``set_to_none=False`` keeps the view and avoids the copy. None and True free a bucket no .grad
            points into between steps (class attribute ``release_idle_buckets``, ``lockstep.ddp.idle_buckets``).
            ``detect_nonfinite=True`` makes None False (the check stops a step before .grad sees the average). With
            False, a CPU parameter of at least ``direct_min_bytes`` (class attribute, 4 MiB; None: never) is
            all-reduced in its own ``.grad``, scaled in place: no copy in or out, values torch's bit for bit; copied
            where that is unsafe (a comm hook, ...: ``lockstep.ddp.copy_in``).
        static_graph: the first iteration records unused parameters and how many pieces each gradient arrives in
            (activation checkpointing); later iterations reuse that.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
        skip_all_reduce_unused_params: not supported; a non-default value raises ValueError naming it.
        device_mesh: a 1-D DeviceMesh whose group is used (not together with process_group).
        bucket_cap_mb_list: the cap of each bucket in turn, in MiB (the last repeats).
        batched_grad_copy: accepted; gradient copies are always batched (one call per bucket).
        forward_sync_buffers: broadcast rank 0's floating/integer buffers before each synchronised forward (default
            True), as torch's ``broadcast_buffers``.
        hang_timeout_s: a rank stuck inside a DDP step this long makes every rank write a hang report (where each rank
            is, whom the others wait for, every thread's stack) and end the job with exit code 86
            (``lockstep.diagnostics.watchdog``). Default: $LOCKSTEP_HANG_TIMEOUT_S, else 300; None or 0: off. Not in
            torch's DDP.
        hierarchical_all_reduce: sum each bucket inside each node, then across nodes, then share it inside
            (``lockstep.collectives.hierarchical``): at 2 nodes x 2 ranks the link carries 2/3 of the flat ring's bytes.
            None (default): on where the launcher names the nodes (GROUP_RANK from lockstep launch / torchrun,
            SLURM_NODEID), the group is the world on gloo, and there are several nodes of as many ranks (>= 2) each;
            True: the same or a ValueError saying why not; False: off. Comm hooks keep the flat group. Sums at 4 ranks
            and more may differ from the flat ring's in the last bits (docs/ddp.md). Not in torch's DDP.

    Args (lockstep's diagnostics, off by default; docs/debugging.md):
        check_replicas_every: every N synchronised steps, check at the next forward that every rank holds the same
            parameters (one all-gather of two 64-bit fingerprints per parameter); a mismatch raises
            ``ReplicaMismatchError`` on every rank naming the parameter, the ranks and the difference.
        detect_nonfinite: check the gradients for NaN/Inf (on CPU at a world size that is a power of two, one sum per
            bucket of copies and the check fused into a direct bucket's scaling, the verdict in the last bucket's spare
            element; elsewhere after the all-reduce: ``lockstep.diagnostics.nonfinite``); every rank raises
            ``NonfiniteGradientError`` naming the rank and the parameter, before the optimizer step. ``.grad`` then
            holds the local values, except a direct bucket's, which holds the average.
        trace_dir: record the overlap timeline of synchronised steps ``trace_steps`` (default 5..10; env
            ``LOCKSTEP_TRACE=DIR``, ``LOCKSTEP_TRACE_STEPS=5:10``); rank 0 writes a Chrome trace, a summary and a PNG
            there when the window closes (at the next forward, or ``self.trace.write()``).

    Differences from torch's DDP, on purpose: a parameter without a gradient raises on every rank at the end of backward
    (naming the parameter and the rank) instead of hanging or failing only on the next iteration, and says which of them
    were replaced or frozen after construction; trainable parameters assigned to the module after construction (a new
    head), which neither DDP averages, are warned about at the next forward (``module_changes``); parameters that differ
    between ranks at the first synchronised forward (changed on some ranks after wrapping: a checkpoint loaded on rank 0
    only) raise ``ReplicaMismatchError`` on every rank, once (off with init_sync=False); the outputs are returned as the
    module made them (torch's ``_DDPSink`` clones them under static_graph / find_unused_parameters). With
    ``gradient_as_bucket_view=None`` (opt-in) ``param.grad`` aliases the bucket buffer after a synchronised backward, as
    with torch's ``gradient_as_bucket_view=True``: a reference to ``.grad`` kept across steps sees the next step's
    averages (``zero_grad(set_to_none=True)`` drops the reference, the next backward writes the same memory), and
    ``.grad`` is a view into a larger buffer (``.grad.data_ptr()`` differs between parameters by their offsets;
    ``.grad._base`` is the buffer). Values and ``state_dict`` are as torch's default.
    """

    direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES  # see gradient_as_bucket_view; a subclass may change it
    small_first_bucket: bool | None = None  # see bucket_cap_mb; None: where it pays (``small_first_bucket_pays``)
    hierarchical_default: bool | None = None  # hierarchical_all_reduce where the keyword is None (the Trainer's DDP)
    release_idle_buckets: bool | None = None  # see gradient_as_bucket_view; None: where it pays (``idle_buckets``)

    def __init__(
        self,
        module: nn.Module,
        device_ids: list | None = None, output_device: Any = None, dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool | None = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        # lockstep's diagnostics (``DiagnosticsOptions``)
        check_replicas_every: int | None = None, detect_nonfinite: bool = False,
        trace_dir: str | None = None, trace_steps: tuple[int, int] | None = None,
        hang_timeout_s: float | None = FROM_ENV,
        hierarchical_all_reduce: bool | None = None,
    ):
        # torch's __init__ never runs (it would build torch's C++ reducer): the subclass is for isinstance.
        nn.Module.__init__(self)
        Joinable.__init__(self)
        self._buffer_hook = None  # set by _register_buffer_comm_hook
        self._lazy_init_done = False  # the first forward's set-up (optimizers in backward)
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        self._bucket_caps = BucketCaps.from_ddp_args(bucket_cap_mb, bucket_cap_mb_list)  # validated there
        diagnostics = DiagnosticsOptions(check_replicas_every, detect_nonfinite, trace_dir, trace_steps)
        reject_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
                           skip_all_reduce_unused_params)
        warn_like_torch(check_reduction, static_graph, find_unused_parameters)
        if process_group is None and device_mesh is None and admission_pending():
            # a node come back joins a running in-place job (train/inplace/): the others are between two steps,
            # so none of the construction's collectives; InPlaceRecovery hands it rank 0's state and re-binds
            init_sync, hierarchical_all_reduce = False, False
        process_group = resolve_group(process_group, device_mesh)
        devices = {p.device for p in module.parameters()}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        if device_ids is not None:
            if len(device_ids) != 1 or any(d.type == "cpu" for d in devices):
                raise ValueError(
                    "DistributedDataParallel: device_ids must be None for a CPU module and a one-element list "
                    f"[device] for a single-GPU module; got device_ids={device_ids} "
                    f"for a module on {sorted(map(str, devices))}"
                )
            index = device_ids[0]
            self.device = torch.device("cuda", index) if isinstance(index, int) else torch.device(index)
        reject_module(module, self.device, ignored_names(module))
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.device_mesh = device_mesh
        self.forward_sync_buffers, init_sync_buffers = resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = self._bucket_caps.bucket_bytes_cap  # torch's attribute (dynamo reads it)
        self._bucket_caps_bytes = self._bucket_caps.caps_bytes
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self.parameters_to_ignore = ignored_names(module)
        self.hang_timeout_s = resolve_hang_timeout(hang_timeout_s)
        self._init_sync = init_sync  # off: no replica check at the first forward either (``diagnose``)
        if not any(p.requires_grad for n, p in module.named_parameters() if n not in self.parameters_to_ignore):
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
                f"gradient. ({type(module).__name__} has {sum(1 for _ in module.parameters())} parameters, none of "
                "which requires grad and is not ignored.)"
            )
        if init_sync:
            named_params = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
            verify_params_across_ranks(named_params, process_group)
            buffers = syncable_buffers(module, self.parameters_to_ignore) if init_sync_buffers else []
            broadcast_coalesced([p for _, p in named_params] + buffers, process_group)
        # Collective where the launcher names several nodes (the layout's gather, the subgroups): every rank here.
        hierarchical = self.hierarchical_default if hierarchical_all_reduce is None else hierarchical_all_reduce
        hierarchy = hierarchy_for(process_group, hierarchical, _HIERARCHY_KEYWORD)
        self.detect_nonfinite = diagnostics.detect_nonfinite  # read by _build_reducer (diagnose.setup sets it too)
        self.reducer = self._build_reducer()
        self.reducer.set_hierarchy(hierarchy)  # not pickled: an unpickled DDP sums flat
        diagnose.setup(self, diagnostics)
        skip_lockstep_in_dynamo()  # where a script compiled before wrapping (else at its first compiled forward)

    def _build_reducer(self) -> TorchReducer:
        ignored = self.parameters_to_ignore
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in ignored]
        view = self.gradient_as_bucket_view
        if view is None and getattr(self, "detect_nonfinite", False):
            # The non-finite check raises before the averages reach .grad; with .grad in the bucket they
            # would be there already. Copies keep its promise (a debugging mode: the copy back is its cost).
            view = False
        caps = self._bucket_caps.for_machine(self.device.type, dist.get_world_size(self.process_group),
                                             self.small_first_bucket, self.direct_min_bytes)
        reducer = TorchReducer(
            [p for _, p in named],
            [n for n, _ in named],
            self.process_group,
            caps,
            gradient_as_bucket_view=view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            sparse=[produces_sparse_gradient(self.module, n) for n, _ in named],
            release_idle_buckets=self.release_idle_buckets,
        )
        reducer.set_module_changes(module_changes.ModuleChanges(self.module, reducer.params, reducer.names,
                                                                self.parameters_to_ignore))
        if watch_for_hangs(self.process_group, getattr(self, "hang_timeout_s", None)):
            reducer.attach_observer(observer_for(reducer))  # the watchdog reads its progress
        return reducer

    def rebind(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Average over ``process_group`` from now on (default: the default group, read now): in-place recovery
        (``lockstep.train.inplace``) re-formed the world. The replicas must already be equal: nothing is broadcast.
        The reducer is made again for the new world size (its hooks and pending works dropped), flat (the
        hierarchy was the old nodes'); the replica check runs at the next synchronised forward."""
        old = self.reducer
        if old.comm_hook is not None or type(old.strategy) is not AllReduce:  # their state holds the old group
            raise RuntimeError("DistributedDataParallel.rebind: not with a comm hook, overlap_optimizer_step or "
                               "zero_optimizer")
        old.remove_hooks()
        old.release_works(keep=False)
        self.process_group = resolve_group(process_group, None)
        self.reducer = self._build_reducer()
        self._lazy_init_done = False
        diagnose.setup(self, DiagnosticsOptions(self.check_replicas_every, self.detect_nonfinite, None, None),
                       check_first=True)  # init_sync=False or not: a rank that joined was built without it

    # ----------------------------------------------------------------- forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """One forward (docs/architecture.md traces it); what a steady step does not need (join, the profiler's
        ranges, a module change, no buffers to send) costs an attribute read."""
        if torch.compiler.is_compiling():  # torch.compile(DDP(module)): ours runs eagerly (``compiled``)
            return forward_outside_dynamo(self.forward, inputs, kwargs)
        if self.device_ids is not None:
            inputs, kwargs = move_to(inputs, self.device), move_to(kwargs, self.device)
        reducer, module = self.reducer, cast(nn.Module, self._modules["module"])  # (nn.Module's __getattr__: a call)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        in_join = self._join_config.enable  # inside model.join() (torch's flag; it stays set after, as torch's)
        check = self._replica_check  # it reads every parameter: a round in flight counts as done (``strategy``)
        check_due = check is not None and reducer.num_syncs + 1 >= check.next_due and check.due(
            reducer.num_syncs + reducer.strategy.round_in_flight())
        if torch._C._autograd._profiler_enabled() is not self._profiling:  # one flag read per forward
            diagnose.toggle_profiler_ranges(self, not self._profiling)
        observer, changes = reducer.observer, reducer.module_changes
        if observer is not None:
            observer.forward_start()
        if changes is not None and changes.seen != module_changes.GENERATION[0]:  # a module or parameter assigned
            changes.warn_not_averaged()  # a layer added or replaced after construction would never be averaged
        if not self._lazy_init_done:  # as torch's lazy init: _apply_optimizer_in_backward may come after construction
            self._lazy_init_done = True
            reducer.take_over_optimizers_in_backward()
        join_work = notify_not_joined(self) if in_join else None  # every forward, as torch
        divisor = (join_divisor(self, join_work) if in_join else reducer.world_size) if synced else None
        reducer.before_forward(in_join or check_due, divisor)  # before any other collective of this iteration
        if synced and check_due and not in_join:  # inside join() a joined rank would not come
            check.maybe_check(reducer.num_syncs)
        nothing = buffer_sync.NOTHING_TO_SEND.get(module)  # (generation, ignore) of the last walk that found none
        pending = self._start_buffer_sync(module, in_join) if (
            self._buffer_hook is not None or nothing is None or nothing[0] != buffer_sync.GENERATION[0]
            or nothing[1] is not self.parameters_to_ignore) else None
        if in_join:
            backward_sync_round(self, synced, joined=False)
        # As torch's: dynamo's active DDP module while the module runs, restored after (``compiled`` says why)
        previous = nn.parallel.DistributedDataParallel._active_ddp_module
        if self.bucket_bytes_cap >= compiled.DYNAMO_FIRST_BUCKET_BYTES:
            nn.parallel.DistributedDataParallel._active_ddp_module = self
        in_compiled = compiled.skipped and compiled.frame_callback() not in (None, False)
        run = compiled.module_for_dynamo(module) if in_compiled else module
        try:
            outputs = run(*inputs, **kwargs)
        finally:
            nn.parallel.DistributedDataParallel._active_ddp_module = previous
            if pending is not None:
                pending.finish()
            reducer.strategy.finish()  # the buckets / all-gathers of parameters this forward did not use
        if observer is not None:
            observer.forward_end()
        if self._buffer_hook is not None and not self._buffer_hook[2] and self._syncs_buffers():
            self._run_buffer_hook()
        # Read again: Lightning sets require_backward_grad_sync inside the module's forward (training_step).
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = synced
        if synced:
            reducer.after_forward(outputs)
            on_backward_start(outputs, reducer.on_backward_start)
        return outputs

    def _syncs_buffers(self) -> bool:  # this forward broadcasts buffers (torch's rule: after a synced forward)
        return self.require_forward_param_sync and self.forward_sync_buffers and self.reducer.world_size > 1

    def _start_buffer_sync(self, module: nn.Module, in_join: bool) -> Any:
        """As torch: buffers follow the *previous* forward. They are broadcast when it was synchronised (so also in
        an eval or no_sync forward right after a training step), which is what keeps BatchNorm statistics
        bit-identical to torch's under gradient accumulation. Returns the pending broadcast, or None. A model whose
        last walk found no buffer to send, and none registered since, costs a dict lookup (``buffer_sync``)."""
        if not self._syncs_buffers():
            return None
        buffer_hook = self._buffer_hook  # torch's _register_buffer_comm_hook: (hook, state, pre?)
        if buffer_hook is not None:
            if buffer_hook[2]:
                self._run_buffer_hook()
            return None
        # Read afresh; waited for before the first BatchNorm where only such layers own buffers (``buffer_sync``).
        # Under join: from a rank still training, waited for here (the join's own collectives come next).
        src = (lambda: common_rank(self, True)) if in_join else (lambda: 0)  # asked only where there are buffers
        return buffer_sync.sync_buffers(module, self.parameters_to_ignore, self.process_group, src, not in_join)

    @property  # torch's is a method; every caller here reads the buffers
    def _sync_buffers(self) -> list[torch.Tensor]:  # type: ignore[override]
        """The module's buffers to broadcast, read afresh: a reassigned buffer is the new tensor (as torch)."""
        return syncable_buffers(self.module, self.parameters_to_ignore)

    def _will_sync_buffers(self) -> bool:
        return self.forward_sync_buffers and dist.get_world_size(self.process_group) > 1 and bool(self._sync_buffers)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward of a forward outside it synchronises the total."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ----------------------------------------------------------- comm hooks
    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` instead of the all-reduce average.

        As in torch, the bucket buffer given to the hook holds the local gradients (not divided by
        the world size) and one hook may be registered, before the first backward. Unlike torch, the
        fp16/bf16 compress hooks (torch's and lockstep's) on this model's group are not called: the
        reducer runs their average itself, with the same bits (``lockstep.ddp.fused_compress``). torch's
        annotation checks apply, but postponed (string) annotations pass (``comm_hooks.base.contract_error``).
        """
        refused = contract_error(hook)  # torch's checks: callable, bucket and return annotations
        if refused is not None:
            self._log_and_throw(refused)
        if self.reducer.comm_hook is not None:
            self._log_and_throw(RuntimeError("register_comm_hook: a communication hook is already registered "
                                             "(one per model)"))
        if self.reducer.num_syncs > 0:
            self._log_and_throw(RuntimeError("register_comm_hook must be called before the first backward"))
        # torch's and lockstep's fp16/bf16 compress hooks: their average run by the reducer (``fused_compress``)
        self.reducer.set_comm_hook(hook, state, fused_compression(hook, state, self.process_group))

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs: ranks out of data shadow the others' collectives (``lockstep.ddp.join``).

        Args:
            divide_by_initial_world_size: average over all ranks (True) or over the ranks still training.
            enable: False turns the context manager into a no-op.
            throw_on_early_termination: raise on every rank as soon as one runs out of data.
        """
        refused = self.reducer.strategy.refuse_join()
        if refused is not None and enable:
            raise RuntimeError(refused)
        return _Join([self], enable, throw_on_early_termination,
                     divide_by_initial_world_size=divide_by_initial_world_size)

    def _set_joining(self, joining: bool) -> None:  # ``_Join``: ZeRO-2's clip is refused inside join()
        self.reducer.strategy.set_joining(joining)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The Joinable interface: what this model does while its rank has joined."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # ----------------------------------------------------------- diagnostics
    def comm_stats(self) -> dict[str, float]:
        """Time this rank spent waiting for all-reduces at the end of backward (not hidden by overlap)."""
        return {"comm_wait_s": self.reducer.comm_wait_s, "steps": self.reducer.num_syncs}

    def overlap_optimizer_step(self, optimizer: torch.optim.Optimizer,
                               sent_during_backward_mb: float | None = None) -> OverlappedOptimizer:
        """Step ``optimizer`` in the next forward, per bucket, as each average lands (not in lockstep's torch API).

        Returns the optimizer to step from now on (``opt = model.overlap_optimizer_step(opt)``; the one given is left
        as it was, and stepping it directly while bound raises). Its ``step()`` returns at once and each module's
        parameters are updated just before that module's next forward runs, once its bucket's average is back; the
        buckets the first layers need are sent ahead of the large late ones. Parameters are bit-identical to the
        plain step for element-wise optimizers
        (SGD, Adam, AdamW, ...). Until the next forward (or ``finish_step()``) ``.grad`` holds this rank's own
        gradients and the parameters the last step's values: see docs/ddp.md#overlapping-the-optimizer-step.

        Args:
            optimizer: the ``torch.optim.Optimizer`` over this model's parameters (not LBFGS).
            sent_during_backward_mb: bytes of buckets sent in index order during backward before the rest go
                first-layers-first; None measures the link over two rounds and agrees across ranks.
        """
        self.reducer.check_unbound("overlap_optimizer_step")
        overlap = OverlappedStep(self.reducer, optimizer, self.module, sent_during_backward_mb)
        self.reducer.bind(overlap, "overlap_optimizer_step")
        return OverlappedOptimizer(overlap)

    def finish_step(self) -> None:
        """With ``overlap_optimizer_step``: wait for every bucket and apply the noted step now (a full wait). Before
        reading ``.grad`` (clipping by global norm, a GradScaler's unscale_) or the parameters outside a forward."""
        self.reducer.strategy.finish()

    def zero_optimizer(self, optimizer_class: type[torch.optim.Optimizer], stage: int = 2,
                       **defaults: Any) -> ZeroOptimizer:
        """ZeRO-2: shard the gradients and ``optimizer_class``'s state over the ranks (not in torch's DDP).

        Each bucket is reduce-scattered instead of all-reduced: this rank keeps its shard of the average and steps
        ``optimizer_class`` on its shard alone; ``opt.step()`` all-gathers the updated parameters per bucket, waited
        for in the next forward where each module first needs them. Per rank, fp32 Adam: 4 + 12/N bytes a parameter
        instead of 16. After a backward ``.grad`` is None (the average lives in the shards): clip with
        ``opt.clip_grad_norm_``. Parameters are plain DDP's bit for bit at 2 ranks for element-wise optimizers.
        Call it on every rank, before the first backward and once: docs/ddp.md#zero-2-sharded-gradients-and-
        optimizer-state.

        Args:
            optimizer_class: an element-wise ``torch.optim.Optimizer`` class (SGD, Adam, AdamW, ...).
            stage: 2 (1 is ``lockstep.ZeroRedundancyOptimizer``).
            **defaults: the optimizer's arguments (``lr=...``), one parameter group.
        """
        self._check_zero(stage, defaults)
        shards = ZeroShards(self.process_group, self.reducer.buckets[0].plan.device, weakref.ref(self.reducer))
        shards.check_hook(self.reducer.comm_hook, self.reducer.fused)
        check_optimizer_class(optimizer_class)
        self.reducer.bind(shards, "zero_optimizer")
        shards.handles = register_waits(self.module, self.reducer.params, shards.finish_params,
                                        shards.finish)
        return ZeroOptimizer(shards, optimizer_class, self.reducer.params, list(self.module.parameters()), defaults)

    def _check_zero(self, stage: int, defaults: dict[str, Any]) -> None:
        """What ZeRO-2 refuses, each with a one-line reason naming the argument."""
        if "params" in defaults:  # ZeRO-1's form: it would reach optimizer_class as a second params (a raw TypeError)
            raise TypeError("zero_optimizer: params= is not an argument: ZeRO-2 steps the parameters of the model this "
                            "DDP wraps (each rank its shard of the buckets); give optimizer_class and its settings "
                            "(lr=...) only. A list of parameters is lockstep.ZeroRedundancyOptimizer(params=..., "
                            "optimizer_class=...) (ZeRO-1)")
        if stage == 1:
            raise ValueError("zero_optimizer: stage=1 is lockstep.ZeroRedundancyOptimizer(params, optimizer_class, "
                             "...) (torch's API); this method is stage=2")
        if stage == 3:
            raise ValueError("zero_optimizer: stage=3 (sharded parameters) is FSDP, which lockstep does not do: wrap "
                             "the model in torch.distributed.fsdp (fully_shard) instead of lockstep's DDP "
                             "(docs/zero.md); this method is stage=2")
        if stage != 2:
            raise ValueError(f"zero_optimizer: stage must be 2 (ZeRO-2; 1 is lockstep.ZeroRedundancyOptimizer, 3 is "
                             f"FSDP: torch.distributed.fsdp), got {stage!r}")
        reducer = self.reducer
        reducer.check_unbound("zero_optimizer")
        if reducer.grad_mode != COPY:
            raise ValueError("zero_optimizer needs gradient_as_bucket_view=False (the default): the buckets are "
                             "freed after their reduce-scatter, so .grad cannot live in them")
        if reducer.tuner is not None:
            raise ValueError('zero_optimizer: bucket_cap_mb="auto" (or the default caps\' trials on a slow link, '
                             "started from the third step) re-lays the buckets, and ZeRO-2 keeps its layout (its "
                             "shards are the buckets'); give a fixed bucket_cap_mb, or bind it before the third step")
        if reducer.has_sparse:
            raise ValueError("zero_optimizer: sparse gradients (nn.Embedding(sparse=True)) cannot be "
                             "reduce-scattered; use dense embeddings")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules (``.module``)
        except AttributeError:
            if name in _CLOSED:
                raise AttributeError(closed_message(name)) from None
            raise


close_inherited(DistributedDataParallel, nn.parallel.DistributedDataParallel)
_CLOSED = frozenset(n for n, v in vars(DistributedDataParallel).items() if type(v).__name__ == "_Closed")


class _Join(Join):
    """torch's ``Join``, which also tells the model while it is open (ZeRO-2's sharded clip cannot be shadowed by a
    rank out of data: it is refused inside, ``ZeroOptimizer.clip_grad_norm_``)."""

    def __enter__(self):
        if self._enable:
            for joinable in self._joinables:
                if isinstance(joinable, DistributedDataParallel):
                    joinable._set_joining(True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for joinable in self._joinables:
                if isinstance(joinable, DistributedDataParallel):
                    joinable._set_joining(False)
