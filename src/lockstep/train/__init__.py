"""Training on top of the DDP: the Trainer with exact checkpoint/resume, metrics, data, and the demo."""

from lockstep.train.trainer import Trainer, TrainerConfig

__all__ = ["Trainer", "TrainerConfig"]
