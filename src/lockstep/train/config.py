"""TrainerConfig: how the Trainer trains, validated on construction so a typo fails before any rank starts."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lockstep.ddp.diloco import DiLoCoConfig
from lockstep.train.precision import AUTOCAST_DTYPES as _AUTOCAST_DTYPES


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass
class TrainerConfig:
    """How to train. Sizes are per rank; the global batch is batch_size * grad_accum_steps * world_size."""

    epochs: int = 1  # passes over the training set
    batch_size: int = 32  # samples per micro-batch, per rank
    grad_accum_steps: int = 1  # micro-batches per optimizer step; all but the last run under no_sync
    # Samples per optimizer step over all ranks. Set, it decides grad_accum_steps
    # (global_batch / (batch_size * world_size)), so the run keeps its batch when it resumes at another
    # world size (docs/preemptible.md); a world size that cannot make it is refused. None: the batch is
    # batch_size * grad_accum_steps * world_size, and a resize keeps the checkpoint's.
    global_batch: int | None = None
    eval_batch_size: int | None = None  # defaults to batch_size
    grad_clip_norm: float | None = None  # clip the all-reduced gradient's total norm to this
    # "bfloat16": autocast forward and loss (CPU and CUDA); "float16": the same with a GradScaler (precision.py),
    # which skips steps with an Inf/NaN gradient, so DDP's detect_nonfinite check is off then
    autocast_dtype: str | None = None
    warmup_steps: int = 0  # linear warm-up of the learning rate over this many optimizer steps
    lr_scale_base_batch: int | None = None  # linear-scaling rule: lr *= global batch / this (Goyal et al. 2017)
    seed: int = 0  # the samplers' shuffle seed (the same on every rank)
    checkpoint_dir: str | None = None  # where ckpt-<step>.pt files go; None: no checkpoints
    save_every_steps: int | None = None  # checkpoint every N optimizer steps (and always at the end)
    keep_last: int = 3  # checkpoints kept; older ones are deleted
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir, if there is one
    # a new run in a checkpoint_dir holding another run's checkpoints stops before training (run_identity.py);
    # overwrite=True deletes those checkpoints instead (global rank 0, before the first step)
    overwrite: bool = False
    metrics_path: str | None = None  # JSON lines written by global rank 0
    log_every_steps: int = 10  # a metrics line every N steps
    # per-run logs in <log_dir>/<run id>/: metrics.csv always, TensorBoard event files when `tensorboard` is installed
    # (loggers.py); None: <folder of metrics_path>/logs, else <checkpoint_dir>/logs, else no log files
    log_dir: str | None = None
    tensorboard: bool = True  # write TensorBoard event files when the tensorboard package is importable
    progress: bool = True  # a tqdm bar on global rank 0
    num_workers: int = 0  # DataLoader workers per rank
    max_steps: int | None = None  # stop after this many optimizer steps in total (resumed ones included)
    # Diagnostics (docs/debugging.md):
    detect_nonfinite: bool = True  # a NaN/Inf gradient raises on every rank, naming its rank and parameter
    # Step the optimizer in the next forward, each bucket's parameters as their average lands (docs/ddp.md,
    # "Overlapping the optimizer step"; the same bits). None: where that is exact (``train.overlap``); True: or raise
    overlap_step: bool | None = None
    # ZeRO (docs/zero.md): 1 shards the optimizer state across the ranks (lockstep.ZeroRedundancyOptimizer), 2 the
    # gradients too (DistributedDataParallel.zero_optimizer); the Trainer builds it from the optimizer it is given
    # (its class, groups and settings). Checkpoints then hold one optimizer part a rank (train/zero.py).
    zero: int | None = None
    # DiLoCo (docs/diloco.md): every node trains on its own and the nodes average every diloco_sync_every optimizer
    # steps (the outer step: SGD with Nesterov momentum on the pseudo-gradients); None: DDP, every step. The rest
    # are DiLoCoConfig's fields of the same name; checkpoints then carry the synced copy and the outer optimizer.
    diloco_sync_every: int | None = None
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    diloco_fragments: int = 1  # > 1: streaming (fragments synced at staggered steps, each overlapped with compute)
    diloco_wire_dtype: str = "fp32"  # "bf16" / "fp16": half the bytes on the link
    diloco_warmup_steps: int = 0  # synchronous steps first (the parameters averaged after each), then the outer loop
    check_replicas_every: int | None = None  # check the replicas' parameters agree every N optimizer steps
    trace_dir: str | None = None  # record the overlap timeline of trace_steps there (Chrome trace, summary, PNG)
    trace_steps: tuple[int, int] = (5, 10)  # first and last optimizer step of the timeline, inclusive
    hang_timeout_s: float | None = None
    # a checkpoint that cannot be written (disk full): "raise" on every rank, or "continue"
    on_save_error: str = "raise"
    preempt_on_sigterm: bool = True  # with checkpoint_dir: SIGTERM -> finish the step, checkpoint, exit 75 (requeue)
    sample_log_path: str | None = None  # per-rank JSON lines of each step's sample ids; "{rank}" is replaced

    def __post_init__(self):
        positive = ["epochs", "batch_size", "grad_accum_steps", "keep_last", "log_every_steps"]
        optional_positive = [
            "global_batch",
            "eval_batch_size",
            "save_every_steps",
            "lr_scale_base_batch",
            "max_steps",
            "check_replicas_every",
        ]
        for name in positive + optional_positive:
            value = getattr(self, name)
            if value is None and name in optional_positive:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainerConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("warmup_steps", "num_workers", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainerConfig.{name} must be an int >= 0, got {value!r}")
        if self.grad_clip_norm is not None and not (
            isinstance(self.grad_clip_norm, (int, float)) and self.grad_clip_norm > 0
        ):
            raise ValueError(f"TrainerConfig.grad_clip_norm must be a number > 0, got {self.grad_clip_norm!r}")
        if self.hang_timeout_s is not None and (isinstance(self.hang_timeout_s, bool) or not (
                isinstance(self.hang_timeout_s, (int, float)) and self.hang_timeout_s >= 0)):
            raise ValueError(
                f"TrainerConfig.hang_timeout_s must be a number >= 0 (0: off) or None, got {self.hang_timeout_s!r}"
            )
        if self.autocast_dtype is not None and self.autocast_dtype not in _AUTOCAST_DTYPES:
            raise ValueError(
                f"TrainerConfig.autocast_dtype must be None or one of {sorted(_AUTOCAST_DTYPES)}, "
                f"got {self.autocast_dtype!r}"
            )
        steps = self.trace_steps
        if not (
            isinstance(steps, (tuple, list))
            and len(steps) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in steps)
            and 1 <= steps[0] <= steps[1]
        ):
            raise ValueError(f"TrainerConfig.trace_steps must be (first, last) with 1 <= first <= last, got {steps!r}")
        if self.overlap_step not in (None, True, False):
            raise ValueError(f"TrainerConfig.overlap_step must be None, True or False, got {self.overlap_step!r}")
        if self.zero not in (None, 0, 1, 2) or isinstance(self.zero, bool):
            raise ValueError(f"TrainerConfig.zero must be None, 1 or 2 (the ZeRO stage), got {self.zero!r}")
        if self.zero and self.overlap_step:
            raise ValueError("TrainerConfig.zero and TrainerConfig.overlap_step=True exclude each other: a ZeRO "
                             "optimizer steps its shard itself; leave overlap_step at None")
        if self.on_save_error not in ("raise", "continue"):
            raise ValueError(f"TrainerConfig.on_save_error must be 'raise' or 'continue', got {self.on_save_error!r}")
        if self.global_batch is not None and self.grad_accum_steps != 1:
            raise ValueError(f"TrainerConfig.global_batch={self.global_batch} decides grad_accum_steps; "
                             f"leave grad_accum_steps at 1 (got {self.grad_accum_steps})")
        if self.global_batch is not None and self.global_batch % self.batch_size:
            raise ValueError(f"TrainerConfig.global_batch={self.global_batch} is not a multiple of "
                             f"batch_size={self.batch_size}")
        if self.resume and self.overwrite:
            raise ValueError("TrainerConfig.resume and TrainerConfig.overwrite exclude each other: "
                             "resume continues the run in checkpoint_dir, overwrite replaces it")
        self.diloco()  # its own validation, in DiLoCoConfig, reported under these fields' names
        if self.diloco_sync_every is not None:
            if self.zero or self.overlap_step:
                raise ValueError("TrainerConfig.diloco_sync_every excludes TrainerConfig.zero and overlap_step=True: "
                                 "each node keeps its own whole optimizer and steps it before the outer sync")
            if self.check_replicas_every is not None:
                raise ValueError("TrainerConfig.diloco_sync_every excludes TrainerConfig.check_replicas_every: the "
                                 "nodes' replicas differ between syncs by design")
        for name in ("resume", "save_every_steps", "overwrite"):
            if getattr(self, name) and self.checkpoint_dir is None:
                raise ValueError(f"TrainerConfig.{name} needs TrainerConfig.checkpoint_dir to be set")

    def diloco(self) -> DiLoCoConfig | None:
        """The DiLoCoConfig of the diloco_* fields (None without diloco_sync_every); a bad value raises a ValueError
        naming the TrainerConfig field."""
        if self.diloco_sync_every is None:
            return None
        try:
            return DiLoCoConfig(sync_every=self.diloco_sync_every, outer_lr=self.diloco_outer_lr,
                                outer_momentum=self.diloco_outer_momentum,
                                nesterov=_positive_number(self.diloco_outer_momentum),
                                wire_dtype=self.diloco_wire_dtype, fragments=self.diloco_fragments,
                                warmup_steps=self.diloco_warmup_steps)
        except ValueError as e:
            raise ValueError(str(e).replace("DiLoCoConfig.", "TrainerConfig.diloco_")) from None

    def resolved_log_dir(self) -> str | None:
        """Where the per-run CSV / TensorBoard folders go (TrainerConfig.log_dir's default spelled out)."""
        if self.log_dir is not None:
            return self.log_dir
        if self.metrics_path is not None:
            return os.path.join(os.path.dirname(self.metrics_path) or ".", "logs")
        return os.path.join(self.checkpoint_dir, "logs") if self.checkpoint_dir is not None else None
