"""Mixed precision for the Trainer: bf16 autocast as it was, and fp16 autocast with a GradScaler.

fp16's range is small (largest 65504, smallest normal 6e-5): gradients underflow unless the loss
is scaled up before backward, and a scale that is too large overflows some of them to Inf. The
GradScaler (torch.amp, as Lightning's ``precision="16-mixed"`` and Accelerate's
``mixed_precision="fp16"`` use it) multiplies the loss by its scale, unscales the gradients before
clipping and the optimizer step, skips the step when any gradient is Inf or NaN and halves the
scale, and doubles it after ``growth_interval`` good steps. Under DDP the gradients it reads are
already averaged, so every rank sees the same Inf and skips the same step. Its state (scale and
growth tracker) goes into the checkpoint, so a resumed run scales and skips as an uninterrupted one.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class Precision:
    """The autocast context, and (fp16) the GradScaler around backward and the optimizer step.

    Args:
        dtype_name: TrainerConfig.autocast_dtype (None: full precision).
        device: the training device (autocast and the scaler are per device type).
        scaler: a GradScaler to use with fp16 (default ``torch.amp.GradScaler(device.type)``).
    """

    def __init__(self, dtype_name: str | None, device: torch.device, scaler: torch.amp.GradScaler | None = None):
        self.dtype = AUTOCAST_DTYPES[dtype_name] if dtype_name is not None else None
        self.device_type = device.type
        if scaler is not None and self.dtype is not torch.float16:
            raise ValueError(f"Trainer: scaler= is for fp16 (TrainerConfig.autocast_dtype='float16'), "
                             f"not autocast_dtype={dtype_name!r}")
        if self.dtype is torch.float16 and scaler is None:
            scaler = torch.amp.GradScaler(device.type)
        self.scaler = scaler
        self.skipped_steps = 0  # optimizer steps the scaler skipped (an Inf or NaN gradient), this process

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip) -> bool:
        """Unscale (fp16), ``clip()``, step the optimizer unless a gradient is Inf/NaN; True if it stepped."""
        if self.scaler is None:
            clip()
            optimizer.step()
            return True
        self.scaler.unscale_(optimizer)  # clipping must see the true gradients
        clip()
        scale = self.scaler.get_scale()  # a host sync on CUDA, once per step (the skip decision needs one anyway)
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= scale  # the scale drops exactly when the step was skipped
        self.skipped_steps += not stepped
        return stepped

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None, path) -> None:
        if (state is None) != (self.scaler is None):
            have = "an fp16 GradScaler" if self.scaler is not None else "no GradScaler"
            raise ValueError(f"checkpoint {path} {'has no' if state is None else 'has a'} GradScaler state and this "
                             f"Trainer has {have} (TrainerConfig.autocast_dtype differs)")
        if state is not None and self.scaler is not None:  # both or neither, checked above
            self.scaler.load_state_dict(state)
