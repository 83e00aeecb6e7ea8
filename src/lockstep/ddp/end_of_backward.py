"""The end of a synchronised backward: wait for the buckets, check, copy the averages back.

Queued by the reducer's ``on_backward_start`` with autograd's ``queue_callback``, so it runs once the whole
backward is done, the only safe point to wait for the buckets. In order: the static graph's first
iteration marks what it learnt; every bucket is launched anyway where a gradient is missing (the other
ranks are waiting in them), with the flag in the last bucket's spare element; the waits (each bucket copied
back right after its own on the common path); the non-finite check; the status exchange, which raises the
missing-gradient error on every rank alike; the copies back; optimizers in backward. A mixin of ``Reducer``.
"""

from __future__ import annotations

import time

from lockstep.ddp.copy_back import copy_back, wait_buckets
from lockstep.ddp.copy_in import COPY
from lockstep.ddp.optim_in_backward import step_optimizers_in_backward
from lockstep.ddp.errors import raise_missing_gradients
from lockstep.ddp.torch_surface import error_for_log


class EndOfBackward:
    """``_finalize_backward`` and ``_reset`` of ``Reducer`` (their state is the reducer's)."""

    def _finalize_backward(self) -> None:
        self._callback_queued = False
        self._fast = None
        hooks_fired, self._hooks_fired = self._hooks_fired, False
        if not hooks_fired and not any(any(b.seen) for b in self.buckets):
            # No parameter of this model got a gradient and nothing was launched: a torch.autograd.grad through
            # the outputs (a gradient penalty, an adversarial attack), a loss that did not depend on the model
            # (torch.func.functional_call with other tensors). Nothing to reduce, as in torch, and, as torch's
            # reducer, still expecting this forward's backward: R1's loss.backward() after its autograd.grad.
            self._reset()
            return
        self.expect_hooks = False
        try:
            if self.usage.in_static_first_iteration():
                # Static graph, iteration 1: nothing was launched during backward; now every count is known.
                order = self.usage.finish_static_first_iteration()
                if self._observed_order is not None:
                    self._observed_order = order
                for i in order + self.usage.static_unused:
                    b, slot = self._location[i]
                    if not self.buckets[b].seen[slot]:  # find_unused_parameters marked the unused ones already
                        self._mark_ready(i, self.params[i].grad)
            missing = [i for b in self.buckets for i, s in zip(b.plan.param_indices, b.seen) if not s]
            # With find_unused_parameters, a parameter reachable from the outputs that got no gradient (an
            # output the loss did not use, an undefined gradient) is unused this time, as in torch, not an
            # error: it contributes zeros and its .grad stays as it was where no rank used it.
            self._missing_flag = bool(missing) and not self.usage.find_unused
            for i in missing:  # launch every bucket anyway: the other ranks are waiting in them
                self._mark_ready(i, self.params[i].grad)
            if not self._missing_flag:
                missing = []
            self._order.drain()
            # Every collective of this backward is issued unless a hook issues some from its callbacks: the status
            # exchange (comm hook, find_unused_parameters) queues behind them and hides behind their waits.
            apart = self._flag_apart()
            launched = None if self._hook_one_in_flight() else self.usage.launch_status(missing, apart, self.buckets[-1], self.process_group)
            fast = not (self.gradient_as_bucket_view or self._graph_grads or self._missing_flag or self._fixups)
            # Torch's order on the common path: each bucket copied back as soon as its wait returns, so the copy
            # overlaps the buckets still in flight. Not where the non-finite check reads the local gradients after
            # the waits, nor where unused parameters must keep their .grad (``copy_back``).
            early = fast and self.grad_mode == COPY and not self.usage.active and self.nonfinite is None
            observer = self.observer
            self.comm_wait_s += wait_buckets(self.buckets, self.comm_hook is not None, observer, early, self._fused_now())
            if self.post_backward_futures:
                start = time.perf_counter()
                futures, self.post_backward_futures = self.post_backward_futures, []
                for future in futures:
                    future.wait()
                self.comm_wait_s += time.perf_counter() - start
            if self.nonfinite is not None:
                self.nonfinite.after_wait(self.buckets, self.comm_hook is not None, apart)  # raises on every rank alike
            status = self.usage.exchange_status(missing, apart, self.buckets[-1], self.process_group, launched=launched)
            if status.any_missing:
                changes = self.module_changes
                raise_missing_gradients(status.missing, self.names, self.process_group, self.usage.static_graph,
                                        status.late, None if changes is None else changes.explain)
            if not early:
                copy_back(self.buckets, self.params, status.globally_used, self.grad_mode, fast)
            if self.optimizers_in_backward:
                step_optimizers_in_backward(self.params)
            self.num_syncs += 1
            self.rounds += 1
            if observer is not None:
                observer.backward_end(self.num_syncs)
            if self._observed_order is not None and not self.buckets_rebuilt:
                self.rebuild_pending = True
        except Exception as error:  # as torch's reducer, noted for the wrapper's logging data
            self.logged_error = error_for_log(error)
            raise
        finally:
            self.dist_autograd.at_end_of_backward(self)  # under distributed autograd: averages into the context
            self._reset()

    def _reset(self) -> None:
        self._fast = None
        self._pending = list(self._sizes)
        self._order.reset()
        self._missing_flag = False
        self._graph_grads = False
        self._fixups = 0
        if self.nonfinite is not None:
            self.nonfinite.reset()
        for bucket in self.buckets:
            bucket.reset()
        self.usage.reset_backward()
