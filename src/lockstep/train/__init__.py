"""Training on top of the DDP: the Trainer with exact checkpoint/resume, metrics, data, and the demo."""

from lockstep.train.config import TrainerConfig
from lockstep.train.trainer import Trainer

__all__ = ["Trainer", "TrainerConfig"]
