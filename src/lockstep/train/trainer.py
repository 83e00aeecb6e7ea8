"""Trainer: the DDP training loop, written once, with exact evaluation and exact resume.

It wraps a model in lockstep's DistributedDataParallel, shards the data with
DistributedSampler, accumulates gradients under ``no_sync``, and checkpoints through
``lockstep.train.checkpoint``. The one idea: everything that decides what happens next —
parameters, optimizer and scheduler state, step, each rank's sampler position and RNG
states — goes into the checkpoint, and nothing else draws randomness (every DataLoader
has its own generator), so a resumed run repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lockstep.ddp.wrapper import DistributedDataParallel
from lockstep.diagnostics.nonfinite import NonfiniteGradientError
from lockstep.diagnostics.progress import set_phase
from lockstep.diagnostics.watchdog import FROM_ENV
from lockstep.process_group import socket_fds
from lockstep.sampler import DistributedSampler
from lockstep.train import checkpoint as ckpt
from lockstep.train import diloco as outer
from lockstep.train.config import TrainerConfig
from lockstep.train.departures import explain_departure, next_fit
from lockstep.train.epoch_meter import EpochMeter
from lockstep.train.evaluate import evaluate
from lockstep.train.faults import install_kill_hooks, kill_point_from_env
from lockstep.train.fence import JobFence
from lockstep.train.inplace import InPlaceGroup, PeerLost, Recovery, Regrouped
from lockstep.train.inplace import wanted as inplace_wanted
from lockstep.train.loggers import open_run_loggers
from lockstep.train.metrics import MetricsLog, comm_report
from lockstep.train.overlap import wants_overlap
from lockstep.train.precision import Precision
from lockstep.train.preempt import (
    REQUEUE_EXIT_CODE,
    Preempted,
    PreemptionWatch,
    leave_marker,
)
from lockstep.train.progress import epoch_line, nothing_left_line, progress_bar, resumed_line, step_postfix
from lockstep.train.resize import accum_steps_for, batches_done_at
from lockstep.train.run_identity import claim_checkpoint_dir
from lockstep.train.stragglers import BLOCKS, find_straggler, gather_epoch, straggler_line
from lockstep.train.zero import load_optimizer_state, sharded_optimizer

__all__ = ["Trainer", "TrainerConfig"]


class SizedDataset(Protocol):
    """A map-style dataset with a length (``TensorDataset``, a ``Dataset`` subclass with ``__len__``): the sampler
    shards it by index."""

    def __getitem__(self, index: int) -> Any: ...
    def __len__(self) -> int: ...


class Trainer:
    """Trains ``model`` on ``train_data`` (items ``(inputs, targets)``) on every rank of ``group``.

    Args:
        model: the plain module; it is moved to ``device`` and wrapped in DDP (``self.ddp``).
        optimizer: built on ``model.parameters()``.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` averaged over the batch.
        train_data, eval_data: map-style datasets. Evaluation counts every sample once.
        config: a TrainerConfig.
        scheduler: stepped after every optimizer step; not allowed together with the
            config's warm-up / linear scaling, which install their own.
        group: the process group (default: the default group). Files are written by global rank 0.
        on_step_end: called with the Trainer after every optimizer step (and any checkpoint); with the overlapped
            step (``TrainerConfig.overlap_step``) that step is applied first, so the callback costs the overlap.
        on_epoch_end: called with the Trainer and the epoch's record (train loss, eval metrics)
            on every rank after each epoch's evaluation.
        scaler: the ``torch.amp.GradScaler`` for TrainerConfig.autocast_dtype="float16" (default: one with
            torch's defaults); its state is checkpointed.
        metric_fn: ``metric_fn(outputs, targets)`` -> a float or a dict of floats, each a mean over the
            batch's samples (MAE, top-5 accuracy...); evaluation weights it by batch size, so the record's
            ``eval_<name>`` is the mean over the whole eval set, each sample counted once.

    Resume is exact (same parameters, bit for bit, on CPU) at the same world size, as long
    as the dataset draws no randomness of its own inside DataLoader workers: after a
    resume the remaining batches are dealt to the workers from worker 0 again. At another
    world size (a node lost or back, docs/preemptible.md) it continues with the same global
    batch and the same samples; only the summation order differs (train/resize.py).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 train_data: SizedDataset, eval_data: Dataset | None = None, config: TrainerConfig | None = None, *,
                 scheduler=None, group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                 on_step_end: Callable[[Trainer], None] | None = None,
                 on_epoch_end: Callable[[Trainer, dict], None] | None = None,
                 scaler: torch.amp.GradScaler | None = None, metric_fn: Callable | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Trainer needs an initialised process group: call lockstep.init() first")
        self.config = cfg = config if config is not None else TrainerConfig()
        if not isinstance(cfg, TrainerConfig):
            raise TypeError(f"Trainer: config must be a TrainerConfig, got {type(cfg).__name__}")
        self.group, self.rank, self.world_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.is_writer = dist.get_rank() == 0  # global rank 0, whatever the group
        if device is None:
            cuda = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.device = torch.device(device)
        model.to(self.device)
        self.precision = Precision(cfg.autocast_dtype, self.device, scaler)  # autocast, and fp16's GradScaler
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # In-place recovery (lockstep launch --nnodes MIN:MAX, docs/preemptible.md): the default group only, and the
        # plain step: the overlapped one would apply the update before the step's commit.
        outer.check_config(cfg, group, in_place=group is None and inplace_wanted())  # before anything starts
        self._recovery = Recovery(InPlaceGroup(), self) if group is None and inplace_wanted() else None
        # A process of a node that came back (train/inplace/, "growing"): the running ranks are between two steps,
        # not building a DDP: it makes none of the construction's collectives and takes the state in fit()
        newcomer = self._joining()
        sockets_before = socket_fds()  # DDP's subgroups (the hierarchical all-reduce): in-place recovery shuts them
        groups = self._diloco_groups(group, newcomer)  # DiLoCo: the DDP runs inside the node (train/diloco.py)
        self.ddp = DistributedDataParallel(
            model, device_ids=device_ids, process_group=group if groups is None else groups.ddp,
            check_replicas_every=cfg.check_replicas_every,
            detect_nonfinite=cfg.detect_nonfinite and self.precision.scaler is None, trace_dir=cfg.trace_dir,
            trace_steps=(cfg.trace_steps[0], cfg.trace_steps[1]) if cfg.trace_dir else None,  # a list given: a tuple
            hang_timeout_s=FROM_ENV if cfg.hang_timeout_s is None else cfg.hang_timeout_s, init_sync=not newcomer,
            hierarchical_all_reduce=False if newcomer else None)
        diloco_config = cfg.diloco()
        self.diloco = None if groups is None or diloco_config is None else outer.build(
            model, diloco_config, groups, init_sync=not newcomer)
        if cfg.zero:  # the optimizer's class, groups and settings, sharded (train/zero.py); before any scheduler
            if scheduler is not None:
                raise ValueError("Trainer: scheduler= was built on the optimizer that TrainerConfig.zero replaces; "
                                 "use TrainerConfig.warmup_steps/lr_scale_base_batch, or zero=None")
            if group is None and inplace_wanted():
                raise ValueError("TrainerConfig.zero: in-place recovery cannot rebuild the optimizer shard of a "
                                 "rank that left; launch with --recovery restart (resumes from the checkpoint)")
            optimizer = sharded_optimizer(self.ddp, optimizer, cfg.zero)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        if self._recovery is not None:
            self._recovery.group.adopt_sockets(socket_fds() - sockets_before)
        self._committed: dict | None = None  # the state the last committed step left (``_snapshot``)
        # Before any scheduler wraps optimizer.step (a scheduler made later wraps the deferred step: torch's order).
        self.overlapped = self._recovery is None and not cfg.zero and self.diloco is None and wants_overlap(
            cfg, optimizer, self.precision.scaler is not None, self.world_size)
        if self.overlapped:  # the bound optimizer steps in the next forward (the user's is left as it was)
            self.optimizer = self.ddp.overlap_optimizer_step(optimizer)
        self._last_step_at = ""  # "(epoch E, batch B of N)" of the last optimizer step: an overlapped step's errors
        self.on_step_end, self.on_epoch_end, self.metric_fn = on_step_end, on_epoch_end, metric_fn
        self.train_data, self.eval_data = train_data, eval_data
        if len(train_data) < self.world_size:  # every rank computes this alike: all raise, no collective needed
            raise ValueError(f"Trainer: train_data has {len(train_data)} samples, fewer than the {self.world_size} "
                             f"ranks; every rank needs at least one sample of its own")
        self.sampler = DistributedSampler(train_data, self.world_size, self.rank, shuffle=True, seed=cfg.seed)
        # micro-batches per optimizer step: from the configured global batch, or the configured count; a resume
        # at another world size recomputes it from the checkpoint's global batch (train/resize.py)
        self.grad_accum_steps = (cfg.grad_accum_steps if cfg.global_batch is None else accum_steps_for(
            cfg.global_batch, cfg.batch_size, self.world_size, "TrainerConfig.global_batch"))
        self.global_batch = cfg.batch_size * self.grad_accum_steps * self.world_size
        if cfg.warmup_steps or cfg.lr_scale_base_batch:
            if scheduler is not None:
                raise ValueError("Trainer: pass either scheduler= or TrainerConfig.warmup_steps/lr_scale_base_batch, "
                                 "not both")
            base, warmup = cfg.lr_scale_base_batch, cfg.warmup_steps
            # lr(step) = base_lr * scale * min(1, (step + 1) / (warmup + 1)): a linear ramp to the scaled lr;
            # the scale reads global_batch when called, which a resize keeps equal to the checkpoint's
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: (self.global_batch / base if base else 1.0) * min(1.0, (s + 1) / (warmup + 1)))
        self.scheduler = scheduler
        self.step, self.epoch, self.batches_done = 0, 0, 0  # batches_done: micro-batches consumed this epoch
        self._loss_sum, self._loss_count = 0.0, 0  # this rank's training loss this epoch (kept in checkpoints)
        self._train_time_s, self._samples_seen = 0.0, 0
        self.history: list[dict] = []
        self.last_checkpoint: Path | str | None = None  # a Path once saved here, its str once loaded or adopted
        self.resumed_from: str | None = None
        self._saved_at: tuple[int, int] | None = None  # (step, epoch) of the last checkpoint saved or loaded
        self.resized_from: int | None = None  # the world size of a checkpoint resumed at another size
        # set by open_writer_files (rank 0's, on every rank); a resume adopts the checkpoint's
        self.run_id: str | None = None
        # the run folder's fence (train/fence.py): claimed in fit() on every rank alike, held (its lease renewed)
        # by the writer; passed on to the next writer when the group re-forms in place
        self.fence: JobFence | None = None
        # rank 0's files checked on every rank alike (a newcomer: rank 0 checked them long ago; its run id comes in fit)
        self.metrics = MetricsLog(None, enabled=False)
        if not self._joining():
            self.metrics, self.run_id = ckpt.open_writer_files(self)
        self.save_errors: list[str] = []  # checkpoints that failed under on_save_error="continue"
        self.preempted = False
        self._watch: PreemptionWatch | None = None
        self._sample_log: TextIO | None = None  # opened by fit() when sample_log_path is set
        self.meter = EpochMeter()  # this epoch's account (epoch_meter.py)
        self._bar: Any = None  # rank 0's bar (``progress_bar``: tqdm's, or a line per refresh)
        self._kill = kill_point_from_env(dist.get_rank())  # test-only fault hook (faults.py); None normally
        if self._kill is not None:
            install_kill_hooks(self, self._kill)

    # -- data ------------------------------------------------------------------------------
    def _loader(self, data, sampler, batch_size: int, epoch: int) -> DataLoader:
        # Its own generator: otherwise each iter(loader) draws a worker seed from torch's global
        # RNG, and a resumed run (one fewer iter() before the checkpoint) would drift from it.
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
        return DataLoader(data, batch_size=batch_size, sampler=sampler, num_workers=self.config.num_workers,
                          generator=generator, pin_memory=self.device.type == "cuda")

    def _autocast(self):
        return self.precision.autocast()

    # -- training --------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train (resuming first if configured), evaluate each epoch, checkpoint; return a summary."""
        cfg = self.config
        self._fit = next_fit()  # names this fit's departure keys in the store (departures.py)
        if cfg.checkpoint_dir and not self._joining():  # one job a folder: refused here while another trains into it
            self.fence = ckpt.claim_folder(self)
        try:
            return self._fit_in_folder()
        finally:
            if self.fence is not None and self.is_writer:
                self.fence.release()  # ended, failed or preempted: a resume (or a requeue) need not wait for the lease

    def _fit_in_folder(self) -> dict:
        """``fit`` once the folder is this job's (or it has none)."""
        cfg = self.config
        joined = self._start_state()
        run_id = self.run_id
        assert run_id is not None  # set on every rank in __init__ (open_writer_files), replaced by a resume
        if cfg.checkpoint_dir and joined is None:  # a new run stops here if the folder holds another run's checkpoints
            claim_checkpoint_dir(cfg.checkpoint_dir, run_id, self.resumed_from is not None, cfg.overwrite,
                                 self.is_writer, self.group)
        self.metrics.run_id = run_id
        if self.resumed_from is not None and not self._report_resume():
            self.metrics.close()
            return self.summary()  # nothing trained: no metrics lines, no checkpoint, no trace
        if self.is_writer and not self.metrics.sinks and (log_dir := cfg.resolved_log_dir()):
            try:  # rank 0 alone: a failure here must not end rank 0 and leave the others waiting
                self.metrics.sinks = open_run_loggers(log_dir, run_id, cfg.tensorboard)  # closed with metrics
            except OSError as e:
                warnings.warn(f"lockstep: no CSV/TensorBoard logs: {log_dir} cannot be written ({e})", stacklevel=2)
        self.metrics.write({"event": "start", "step": self.step,
                            "resumed_from": str(self.resumed_from) if self.resumed_from else None})
        # under lockstep launch: the launcher's membership line names the step the workers resumed from
        from lockstep.launch.elastic import report_resume  # lazy: lockstep.launch imports torch's elastic agent

        report_resume(self.step if self.resumed_from else None, self.world_size, self.resized_from)
        watch = PreemptionWatch(self.group, self.device) if cfg.checkpoint_dir and cfg.preempt_on_sigterm else None
        self._watch = watch
        try:
            if watch is not None:
                watch.install()
            if cfg.sample_log_path:
                self._open_sample_log(cfg.sample_log_path)
            self._run_epochs()
            if self.ddp.trace is not None and not self.ddp.trace.finished:
                self.ddp.trace.write()  # a run shorter than the window: write what was recorded
        except BaseException as e:
            explain_departure(self, e)  # tell the others why this rank leaves, or name the rank that left
            raise
        finally:
            if watch is not None:
                watch.uninstall()
            if self._recovery is not None:
                self._recovery.group.stop()
            if self._sample_log is not None:
                self._sample_log.close()
            self.metrics.close()
        if self.preempted:
            print(f"lockstep: rank {self.rank} preempted: stopped after step {self.step}, checkpoint "
                  f"{self.last_checkpoint}; exiting with {REQUEUE_EXIT_CODE} (requeue)", file=sys.stderr, flush=True)
            leave_marker(dist.get_rank(), self.step, str(self.last_checkpoint))
            raise Preempted(self.step, str(self.last_checkpoint))
        return self.summary()

    def _run_epochs(self) -> None:
        """The epochs left, then the last checkpoint; with in-place recovery a lost peer's survivors go on from the
        last committed step, a peer lost during that checkpoint's collectives included (the survivors save it)."""
        if self._recovery is not None:
            self._recovery.group.start()  # stopped at the end of the last fit
            self._recovery.group.accept_joins()  # a node that comes back joins at a step boundary (``Recovery.grow``)
        while True:
            try:
                while self.epoch < self.config.epochs and not self._stopped() and not self.preempted:
                    if not self._train_epoch():
                        break  # stopped mid-epoch by max_steps or preemption: no epoch summary
                    self._end_epoch()
                self._save_at_the_end()
                if self._recovery is not None:
                    self._recovery.report(self.step)  # re-formed in that save: no step follows to say it
                    self._recovery.group.finish(self.step)  # a node still waiting to be admitted has nothing to join
                return
            except Exception as e:
                if self._recovery is None:
                    raise
                self._recover(e)

    def _save_at_the_end(self) -> None:
        if self._watch is not None:
            self._watch.drain()
        # the position, not the step: a save at an epoch's last step precedes its evaluation, and a checkpoint
        # left there would make a finished run resume into that evaluation again and again
        if self.config.checkpoint_dir and self._saved_at != (self.step, self.epoch):
            self.save_checkpoint(on_error="raise" if self.preempted else None)

    def _report_resume(self) -> bool:
        """Rank 0 says where the run resumed, or that nothing is left to train; False in the latter case (every
        rank decides alike, from the same checkpoint)."""
        cfg, path = self.config, str(self.resumed_from)
        if self.epoch >= cfg.epochs or self._stopped():
            if self.is_writer:
                print(nothing_left_line(path, self.step, self.epoch, cfg.epochs, cfg.max_steps), flush=True)
            return False
        if self.is_writer:
            # the sampler holds what is left of the resumed epoch; the DataLoader keeps the last short batch
            epoch_batches = self.batches_done + math.ceil(len(self.sampler) / cfg.batch_size)
            print(resumed_line(path, self.step, self.epoch, self.batches_done, epoch_batches, cfg.epochs,
                               self.resized_from, self.world_size), flush=True)  # stdout: the bar's stream
        return True

    def _open_sample_log(self, path_template: str) -> None:
        path = path_template.replace("{rank}", str(self.rank))
        self._sample_log = open(path, "a", buffering=1)  # line-buffered: each step's line survives a SIGKILL
        self._sample_log.write(json.dumps({"event": "start", "step": self.step, "resumed_from": self.resumed_from})
                               + "\n")

    def _stopped(self) -> bool:
        return self.config.max_steps is not None and self.step >= self.config.max_steps

    def _train_epoch(self) -> bool:
        """One pass over this rank's shard, from the resumed position; False if max_steps cut it short."""
        cfg, accum = self.config, self.grad_accum_steps
        self.sampler.set_epoch(self.epoch)
        loader = self._loader(self.train_data, self.sampler, cfg.batch_size, self.epoch)
        n_batches = self.batches_done + len(loader)
        self.ddp.train()
        self._bar = bar = self._progress_bar(n_batches)
        self.meter = meter = EpochMeter(comm_wait_at_start_s=self._comm_wait_total_s() or 0.0)
        t_group, group_samples = time.perf_counter(), 0
        t_data = t_group
        set_phase("data")  # for a hang report: the Trainer knows its phases, DDP only forward/backward
        step_ids: list[int] | None = [] if self._sample_log is not None else None
        self._snapshot()
        for i, (inputs, targets) in enumerate(loader, start=self.batches_done):
            tracer = self.ddp.trace  # the timeline's data and optimizer phases (None unless tracing)
            t_batch = time.perf_counter()
            meter.data_s += t_batch - t_data
            if tracer is not None:
                tracer.mark("data", t_data, t_batch)
            group_start = i - i % accum  # resumed positions are always at a group boundary
            group_size = min(accum, n_batches - group_start)  # a short last group is averaged over its size
            sync = i + 1 == group_start + group_size
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            if self.overlapped:  # the last step's verdicts (NaN, missing gradient) before this forward: that step's
                try:
                    self.ddp.reducer.strategy.at_forward_start(False)
                except NonfiniteGradientError as e:
                    raise NonfiniteGradientError(f"at optimizer step {self.step} {self._last_step_at}: {e.detail}",
                                                 self.step, e.detail) from None
            # forward too must run under no_sync: DDP decides at forward time whether backward syncs
            try:
                with contextlib.nullcontext() if sync else self.ddp.no_sync():
                    with self._autocast():
                        loss = self.loss_fn(self.ddp(inputs), targets)
                    self.precision.backward(loss / group_size)  # scaled first with fp16
            except NonfiniteGradientError as e:  # DDP knows the rank and parameter; the Trainer says when its way
                raise NonfiniteGradientError(f"at optimizer step {self.step + 1} (epoch {self.epoch + 1}, batch "
                                             f"{i + 1} of {n_batches}): {e.detail}", self.step + 1, e.detail) from None
            loss_value = loss.item()  # one host sync per micro-batch (free on CPU) for the bar and the epoch mean
            self._loss_sum += loss_value * len(targets)
            self._loss_count += len(targets)
            group_samples += len(targets)
            self.batches_done = i + 1
            if step_ids is not None:  # audit log only: positions consumed so far -> dataset indices
                consumed = self.sampler.consumed
                step_ids += self.sampler.indices(consumed, consumed + len(targets))
            self.sampler.advance(len(targets))  # what was consumed, not what the loader prefetched
            t_data = time.perf_counter()
            if not sync:
                set_phase("data")
                continue
            set_phase("optimizer")
            self._last_step_at = f"(epoch {self.epoch + 1}, batch {i + 1} of {n_batches})"
            # every rank's averages completed (else PeerLost: the step is discarded everywhere); DiLoCo commits
            # after its exchange instead (below)
            regrouped = self._commit() if self.diloco is None else None
            self.precision.step(self.optimizer, self._clip)  # fp16: unscaled, then skipped on an Inf/NaN
            self.optimizer.zero_grad(set_to_none=True)
            if self.diloco is not None:  # every H steps the outer sync (its cost is in this step's time): its
                self.diloco.exchange()  # all-reduce, then the commit, which proves every rank's complete, then
                regrouped = self._commit()  # the outer step; a failure before it leaves each rank at its last
                self.diloco.apply()  # sync point, the inner steps since lost (``_snapshot``)
            if self.scheduler is not None:
                self.scheduler.step()
            if tracer is not None:
                tracer.mark("optimizer", t_data, time.perf_counter())
            self.step += 1
            now = time.perf_counter()
            step_s, t_group = now - t_group, now
            self._train_time_s += step_s
            self._samples_seen += group_samples * self.world_size  # every rank steps through equal shards
            meter.add_step(step_s, group_samples * self.world_size)
            meter.update_comm(self._comm_wait_total_s())
            group_samples = 0
            if step_ids is not None and self._sample_log is not None:  # both or neither
                self._sample_log.write(json.dumps({"step": self.step, "epoch": self.epoch + 1, "ids": step_ids}) + "\n")
                step_ids = []
            if self._recovery is not None:
                self._after_commit(regrouped)
            self._after_step(loss_value, bar, step_s)
            if regrouped is not None or self._grow_if_due() is not None:
                bar.close()
                raise _Resized  # the rest of the epoch is dealt again at the new size
            t_group = t_data = time.perf_counter()  # logging and checkpoints are not step time
            set_phase("data")
            if self._watch is not None and self._watch.should_stop():  # every rank agrees on the same step
                self.preempted = True
                bar.close()
                return False
            if self._stopped() and self.batches_done < n_batches:
                bar.close()
                return False
        return True  # the bar stays open: _end_epoch shows the epoch's all-rank loss on its last line

    # -- in-place recovery (train/inplace/: Recovery does what a script's loop and the Trainer share) ------
    def _commit(self) -> Regrouped | None:
        return self._recovery.commit(self.step + 1) if self._recovery is not None else None

    def _snapshot(self) -> None:
        """What the last committed step left: the state a lost peer rolls every survivor back to. No tensors: the
        parameters and the optimizer change only after a commit. DiLoCo: the last sync point instead, where
        the replicas agree (``outer.snapshot``: this rank's inner optimizer copied), kept until the next one."""
        outer_state = None
        if self.diloco is not None and self._recovery is not None:
            if not self.diloco.at_sync_point and self._committed is not None:
                return  # between two syncs: a loss goes back to the last one
            outer_state = outer.snapshot(self.diloco, self.optimizer, self.scheduler, self.precision)
        self._committed = {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done,
                           "sampler": self.sampler.state_dict(), "loss": (self._loss_sum, self._loss_count),
                           "seen": (self._samples_seen, self._train_time_s), "outer": outer_state}

    def _after_commit(self, regrouped: Regrouped | None) -> None:
        assert self._recovery is not None
        if regrouped is not None and self.diloco is not None and not self.diloco.at_sync_point:
            raise PeerLost(regrouped)  # applied, but DiLoCo goes back to its last sync point (``_recover``)
        self._snapshot()
        if regrouped is not None:  # this rank's commit failed after the others': it applied the step, now resize
            self._recovery.regroup(regrouped)
        else:
            self._recovery.report(self.step)  # the last re-formation's line, after the first step at its size

    def _start_state(self) -> Regrouped | None:
        """Where fit() starts: a newcomer's admission (it takes the running job's state from its rank 0, no
        checkpoint read; returned), else the newest checkpoint where ``resume`` asks for it (None)."""
        joined = self._recovery.join() if self._recovery is not None else None
        if joined is None and self.config.resume:
            self.load_latest()
        return joined

    def _diloco_groups(self, group: dist.ProcessGroup | None, newcomer: bool) -> outer.DiLoCoGroups | None:
        """DiLoCo's groups where the config asks for it (before the DDP, which runs on the node's group). A
        newcomer's are made with the others' at its admission (``ddp_group``)."""
        if self.config.diloco_sync_every is None:
            return None
        return outer.DiLoCoGroups(None, None, None) if newcomer else outer.make_groups()

    def _grow_if_due(self) -> Regrouped | None:
        """Admit the nodes waiting to join where the last commit said so and this is a boundary they may join at
        (DiLoCo: a sync point, where a newcomer takes the anchors every replica holds; the commits until then say
        it again). None where nobody joined."""
        if self._recovery is None or not self._recovery.grow_due:
            return None
        if self.diloco is not None and not self.diloco.at_sync_point:
            return None
        return self._recovery.grow()

    def _joining(self) -> bool:
        """This process joins a running in-place job (a node come back) and has not taken its state yet."""
        return self._recovery is not None and self._recovery.joining

    def _recover(self, error: Exception) -> None:
        """A collective failed: rejoin the survivors, go back to the last committed step, continue at the new size."""
        assert self._recovery is not None and self._committed is not None
        if isinstance(error, _Resized):
            return  # already re-formed and resized (``_after_commit``)
        outcome = self._recovery.lost(error)
        saved = self._committed
        self.step, self.epoch = saved["step"], saved["epoch"]
        (self._loss_sum, self._loss_count), (self._samples_seen, self._train_time_s) = saved["loss"], saved["seen"]
        if self.diloco is not None:  # back to the last sync point: its epochs' records come again
            outer.rewind(self.diloco, self.optimizer, self.scheduler, self.precision, saved["outer"])
            self.history = [record for record in self.history if record["epoch"] <= self.epoch]
            if self._sample_log is not None:  # the steps logged since are undone: a reader drops them
                self._sample_log.write(json.dumps({"event": "rewind", "step": self.step}) + "\n")
        if self._bar is not None:
            self._bar.close()
        self._recovery.regroup(outcome)

    # RecoveringLoop (train/inplace/recovery.py): what in-place recovery asks of the Trainer
    def live_state(self) -> dict:
        """What a newcomer needs to take the next step as if it had trained all along (rank 0's): parameters and
        buffers, optimizer, scheduler, scaler, step and data position, the run's and the folder's identity; with
        DiLoCo (a sync point) the anchors, the outer optimizer and the schedule's position."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "diloco": self.diloco.state_dict() if self.diloco is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.precision.state_dict(), "global_batch": self.global_batch,
                # without this rank's own rollback point (DiLoCo's optimizer copy): the newcomer takes its own
                "committed": None if self._committed is None else {**self._committed, "outer": None},
                "run_id": self.run_id, "saved_at": self._saved_at,
                "job": self.fence.job if self.fence is not None else None,
                "last_checkpoint": None if self.last_checkpoint is None else str(self.last_checkpoint)}

    def adopt(self, state: dict) -> None:
        """A newcomer takes rank 0's ``live_state()``."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.diloco is not None:
            self.diloco.load_state_dict(state["diloco"])
            self.diloco.reset_to_global()  # the model's parameters are its anchors already: a sync point
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["scaler"], "(in-place join: rank 0's state)")
        saved = state["committed"]
        self.step, self.epoch = saved["step"], saved["epoch"]
        self._samples_seen, self._train_time_s = saved["seen"]
        # the epoch's running loss stays the others' (its mean is over every rank's sums): this rank's share is 0
        self._committed = {**saved, "loss": (0.0, 0)}
        self.global_batch, self.run_id, self.last_checkpoint = state["global_batch"], state["run_id"], \
            state["last_checkpoint"]
        self._saved_at = None if state["saved_at"] is None else tuple(state["saved_at"])
        if state["job"] is not None and self.config.checkpoint_dir:
            self.fence = JobFence(self.config.checkpoint_dir, state["job"])  # the job's: a later writer advances it

    def committed_sampler_state(self) -> dict:
        assert self._committed is not None
        return self._committed["sampler"]

    def committed_step(self) -> int:
        return self.step

    def ddp_group(self) -> dist.ProcessGroup | None:
        """The DDP's group at the new size: the default one, or with DiLoCo the node's, DiLoCo's groups made anew
        over the new world (their sockets shut with the group's on the next loss)."""
        if self.diloco is None:
            return None
        assert self._recovery is not None
        sockets_before = socket_fds()
        groups = outer.make_groups()
        self._recovery.group.adopt_sockets(socket_fds() - sockets_before)
        self.diloco.regroup(groups.cross, groups.node)
        return groups.ddp

    def resized(self, outcome: Regrouped) -> None:
        """After the DDP was re-bound and the sampler re-dealt at the new size: this rank's place, the folder's
        writer, the accumulation that keeps the global batch, the epoch's position at the new size."""
        assert self._committed is not None
        cfg, saved = self.config, self._committed
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_writer = self.rank == 0
        if self.is_writer and self.fence is not None:  # a new membership, a new generation: the old writer is passed
            self.fence.advance(f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
        if self._watch is not None:
            self._watch.forget_pending()  # issued on the old group
        where = f"in-place recovery at world size {self.world_size}"
        self.grad_accum_steps = accum_steps_for(self.global_batch, cfg.batch_size, self.world_size, where)
        self.batches_done = batches_done_at(saved["sampler"]["position"], saved["batches_done"], cfg.batch_size,
                                            self.world_size, where)
        self.resized_from = outcome.old_world_size
        self._snapshot()

    def _clip(self) -> None:
        if self.config.grad_clip_norm is None:
            return
        sharded = getattr(self.optimizer, "clip_grad_norm_", None)  # ZeRO-2: the averaged gradient is in shards
        if sharded is not None:  # the global norm: one all-reduce of the shards' parts
            sharded(self.config.grad_clip_norm)
        else:  # the gradient is already averaged: every rank clips alike
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip_norm)

    def _comm_wait_total_s(self) -> float | None:
        stats = getattr(self.ddp, "comm_stats", None)
        return float(stats()["comm_wait_s"]) if callable(stats) else None

    def _after_step(self, loss_value: float, bar, step_s: float) -> None:
        cfg, meter = self.config, self.meter
        share = meter.comm_share if self._comm_wait_total_s() is not None else None
        # the bar: this rank's mean loss so far this epoch (the last line: every rank's, as the summary's)
        running_loss = self._loss_sum / self._loss_count if self._loss_count else loss_value
        bar.set_postfix({**step_postfix(running_loss, meter.samples_per_s, step_s, share),
                         **outer.sync_postfix(self.diloco)}, refresh=False)
        bar.update(1)
        if self.step % cfg.log_every_steps == 0:
            lr = self.optimizer.param_groups[0]["lr"]
            self.metrics.write({"event": "train", "step": self.step, "epoch": self.epoch + 1, "loss": loss_value,
                                "lr": lr, "samples_per_s": meter.samples_per_s, "comm_share": share,
                                **outer.sync_metrics(self.diloco)})
        if cfg.save_every_steps and self.step % cfg.save_every_steps == 0:
            self.save_checkpoint()
        if self.on_step_end is not None:
            if self.overlapped:
                self.ddp.finish_step()  # the callback reads the model: the step applied, not in flight (a full wait)
            self.on_step_end(self)

    def _progress_bar(self, n_batches: int):
        accum = self.grad_accum_steps
        return progress_bar(math.ceil(n_batches / accum), self.batches_done // accum, f"epoch {self.epoch + 1}",
                            enabled=self.is_writer and self.config.progress)

    def _end_epoch(self) -> None:
        set_phase("eval")
        meter = self.meter
        if self.overlapped:
            self.ddp.finish_step()  # the epoch's last step lands in it: its wait counts here, its update is evaluated
        meter.update_comm(self._comm_wait_total_s())
        # one collective per epoch: every rank's loss totals and phases (stragglers.py)
        ranks = gather_epoch(self._loss_sum, self._loss_count, meter.phases(), meter.comm_blocks(BLOCKS), self.device,
                             self.group)
        totals = [sum(r["loss_sum"] for r in ranks), sum(r["loss_count"] for r in ranks)]
        # epochs count from 1 in everything shown (bar, summary, metrics, curves); self.epoch counts done ones
        train_loss = totals[0] / totals[1] if totals[1] else float("nan")
        record = {"event": "epoch", "epoch": self.epoch + 1, "step": self.step, "train_loss": train_loss,
                  "samples_per_s": meter.samples_per_s}  # this epoch's, as the bar's
        share = meter.comm_share if self._comm_wait_total_s() is not None else None
        if share is not None:
            record["comm_share"] = share
        self._bar.set_postfix(step_postfix(train_loss, meter.samples_per_s, meter.last_step_s, share),
                              refresh=False)
        self._bar.close()
        straggler = find_straggler(ranks)  # the same on every rank: computed from the same gathered numbers
        if straggler is not None:
            record["straggler"] = {k: straggler[k] for k in ("rank", "cause", "wait_share")}
            if self.is_writer and self.config.progress:
                print(straggler_line(self.epoch + 1, straggler), flush=True)  # stdout: the bar's stream
        if self.eval_data is not None:
            record.update(self.evaluate())
        if self.is_writer and self.config.progress:
            print(epoch_line(record), flush=True)  # stdout, after the bar's last line and any straggler line
        self.history.append(record)
        self.metrics.write(record)
        # the position moves to the next epoch's start first, so a checkpoint saved by the callback
        # resumes there (instead of re-running this epoch's evaluation)
        self.epoch, self.batches_done = self.epoch + 1, 0
        self._loss_sum, self._loss_count = 0.0, 0
        if self.on_epoch_end is not None:
            self.on_epoch_end(self, record)

    def evaluate(self) -> dict:
        """Loss (and accuracy for class-index targets) over the eval set, each sample counted once; with DiLoCo, of
        the parameters of the last sync (the model every node agrees on)."""
        with contextlib.nullcontext() if self.diloco is None else self.diloco.global_parameters():
            return evaluate(self.model, self.loss_fn, self.eval_data, self._loader, self.world_size, self.rank,
                            self.config.eval_batch_size or self.config.batch_size, self.device, self._autocast,
                            self.group, metric_fn=self.metric_fn)

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, on_error: str | None = None):
        """Every rank must call this (it gathers each rank's sampler position and RNG); global rank 0 writes.

        ``on_error`` ("raise" / "continue") overrides TrainerConfig.on_save_error for this save."""
        saved = ckpt.save_trainer_checkpoint(self, on_error)
        if saved.error is not None:
            self.save_errors.append(saved.error)
        else:
            self._saved_at, self.last_checkpoint = (self.step, self.epoch), saved.checkpoint
        return saved.path

    def load_latest(self):
        """Load the newest checkpoint in checkpoint_dir on every rank; returns its path, or None if there is none."""
        state = ckpt.load_trainer_checkpoint(self)
        if state is None:
            return None
        self._resume(state)
        return state.path

    def _resume(self, state: ckpt.ResumedState) -> None:
        """Take a checkpoint read back (``checkpoint.load_trainer_checkpoint``, checked already): the model, the
        optimizer, the scheduler and the scaler, where training stands, this rank's data position, loss and RNG.
        The RNG last: nothing after it may draw randomness."""
        self.model.load_state_dict(state.model)
        load_optimizer_state(self.optimizer, state.optimizer, state.own_shard)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
        self.precision.load_state_dict(state.scaler, state.path)
        if self.diloco is not None and state.diloco is not None:  # the synced copy and outer optimizer (checked
            outer.load(self.diloco, self.model, self.optimizer, state.diloco, state.diloco_local)  # both or neither)
        self.step, self.epoch, self.batches_done = state.step, state.epoch, state.batches_done
        if state.run_id:  # the resumed run is that run: its later checkpoints and metrics lines join it
            self.run_id = state.run_id
        self._saved_at = (self.step, self.epoch)
        if state.resized_from is not None:  # the same global batch at this world size (train/resize.py)
            assert state.global_batch is not None and state.grad_accum_steps is not None
            self.grad_accum_steps, self.global_batch = state.grad_accum_steps, state.global_batch
            self.resized_from = state.resized_from
        self.sampler.load_state_dict(state.sampler)
        self._loss_sum, self._loss_count = state.loss_sum, state.loss_count
        state.restore_rng(self.config.seed, self.rank)
        self.last_checkpoint = self.resumed_from = state.path

    # -- reporting -------------------------------------------------------------------------
    def comm_report(self) -> dict:
        """Share of step time spent in communication (see ``lockstep.train.metrics.comm_report``)."""
        return comm_report(self)

    def summary(self) -> dict:
        last = self.history[-1] if self.history else {}
        # the last epoch's record first: its samples_per_s is that epoch's, the summary's is the whole run's
        return {**last, "steps": self.step, "epochs": self.epoch, "history": self.history,
                "samples_per_s": self._samples_seen / self._train_time_s if self._train_time_s else 0.0,
                "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None}


class _Resized(Exception):
    """Out of the epoch's loop after a step applied by a rank whose commit failed late (``Trainer._after_commit``)."""
