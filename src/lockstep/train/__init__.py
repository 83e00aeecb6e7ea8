"""Training on top of the DDP: the Trainer with exact checkpoint/resume, metrics, data, and the demo."""

from lockstep.train.checkpoint_files import CheckpointSaveError
from lockstep.train.config import TrainerConfig
from lockstep.train.departures import PeerLeft
from lockstep.train.fence import JobFenceError, StaleGenerationError
from lockstep.train.preempt import REQUEUE_EXIT_CODE, Preempted
from lockstep.train.run_identity import RunConflictError
from lockstep.train.trainer import Trainer

__all__ = [
    "REQUEUE_EXIT_CODE",
    "CheckpointSaveError",
    "JobFenceError",
    "PeerLeft",
    "Preempted",
    "RunConflictError",
    "StaleGenerationError",
    "Trainer",
    "TrainerConfig",
]
