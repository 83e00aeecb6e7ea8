"""Transformers' Trainer on 2 CPU ranks with torch's DDP or lockstep's (IMPL=torch|lockstep|lockstep,torch).

    IMPL=lockstep,torch OUT=/tmp/hf torchrun --nproc_per_node 2 hf_trainer_run.py

A tiny Llama built from its config (seeded, nothing downloaded) learns generated token sequences. Trainer wraps
the model through Accelerate with its own DDP arguments: ``find_unused_parameters=True`` by default, and
``False`` with ``GRAD_CKPT=1`` (activation checkpointing, non-reentrant). Covers: gradient accumulation (Accelerate's no_sync), gradient clipping, a checkpoint every 4 steps,
``resume_from_checkpoint`` into a fresh Trainer (the resumed run must end where the straight run ended), the
saved model loading without lockstep. Rank 0 writes each run's final state dict and a report to $OUT/<impl>.pt, its
checkpoints under $OUT/<impl>/. IMPL=lockstep,torch: both runs in the same processes, lockstep's first.
"""

from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

torch.set_num_threads(1)
from common import OUT, RUNS, check_ddp_class, out_path, save_result, switch_to  # noqa: E402

switch_to(RUNS[0])  # before transformers is imported, as a script that calls use_as_torch_ddp() at its top

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers import set_seed  # noqa: E402

VOCAB, SEQ, ROWS = 64, 16, 256
GRAD_CKPT = os.environ.get("GRAD_CKPT", "0") == "1"


class TokenRows(torch.utils.data.Dataset):
    """Sequences of a noisy counting pattern: learnable, generated, the same on every rank."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
        step = torch.randint(1, 4, (ROWS, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model() -> LlamaForCausalLM:
    set_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


class SeeWrapper(TrainerCallback):
    """Records which class wrapped the model (Trainer's ``model_wrapped``) at the first step."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.cls = ""
        self.find_unused: bool | None = None
        self.checkpointing: bool | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if not self.cls and self.trainer is not None:
            ddp = self.trainer.model_wrapped
            self.cls = check_ddp_class(ddp)
            self.find_unused = bool(ddp.find_unused_parameters)
            module = ddp.module
            self.checkpointing = bool(getattr(module, "is_activation_checkpointing", None) or module.is_gradient_checkpointing)


def _checkpointing_args() -> dict:
    """GRAD_CKPT=1: activation checkpointing (Transformers 5 renamed ``gradient_checkpointing`` to ``activation_checkpointing``)."""
    if not GRAD_CKPT:
        return {}
    import dataclasses

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    prefix = "activation" if "activation_checkpointing" in names else "gradient"
    return {f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}


def train(out_dir: str, max_steps: int, resume: str | None = None) -> tuple[Trainer, SeeWrapper]:
    args = TrainingArguments(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=3e-3, max_grad_norm=0.5, warmup_steps=2, lr_scheduler_type="linear", logging_steps=4,
        save_strategy="steps", save_steps=4, save_total_limit=3, report_to=[], seed=0, data_seed=0,
        use_cpu=True, dataloader_num_workers=0, ddp_bucket_cap_mb=1,
        **_checkpointing_args(),
    )
    seen = SeeWrapper()
    trainer = Trainer(model=make_model(), args=args, train_dataset=TokenRows(), callbacks=[seen])
    seen.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer, seen


def run(impl: str) -> tuple[Trainer, Trainer]:
    switch_to(impl)
    work = os.path.join(OUT, impl)
    trainer, seen = train(os.path.join(work, "run"), max_steps=12)
    straight = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    # A fresh Trainer resumes from the step-8 checkpoint (model, optimizer, scheduler, RNG, data position).
    resumed, _ = train(os.path.join(work, "run"), max_steps=12, resume=os.path.join(work, "run", "checkpoint-8"))
    again = resumed.model.state_dict()
    resumed_equal = all(torch.equal(straight[k], again[k]) for k in straight)
    resumed.save_model(os.path.join(work, "final"))
    if trainer.args.process_index == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        report = {"class": seen.cls, "resumed_equal": resumed_equal, "loss_fell": losses[-1] < losses[0],
                  "losses": losses, "setup": {"find_unused": seen.find_unused, "checkpointing": seen.checkpointing}}
        save_result(out_path(impl), {**straight, "__report__": report})
    return trainer, resumed


def main() -> None:
    kept = {}
    for impl in RUNS:
        kept[impl] = run(impl)
    if len(kept) > 1:
        # torch's Trainers (a cycle through the SeeWrapper callback) go while the group lives, lockstep's stay to the
        # end as in a run of its own: torch's DDP freed after destroy_process_group frees the group, whose destructor
        # joins gloo's workers holding the GIL (a worker still letting go of a work waits for it for good: hangs seen
        # in test_examples' combined run).
        del kept["torch"]
        gc.collect()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
