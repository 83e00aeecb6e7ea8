"""Lightning 2.6 on 2 CPU ranks with torch's DDP or lockstep's.

    IMPL=torch    STRATEGY=ddp          python lightning_run.py   # torch's DDP
    IMPL=lockstep STRATEGY=ddp          python lightning_run.py   # use_as_torch_ddp() (or LOCKSTEP_AS_TORCH_DDP=1)
    IMPL=lockstep STRATEGY=lockstep_ddp python lightning_run.py   # the registered strategy
    IMPL=lockstep,torch STRATEGY=...    python lightning_run.py   # lockstep's, then torch's ("ddp"), same processes

Lightning's "ddp" launcher re-runs this script for rank 1 (popen). Three fits in one process group:
  1. automatic optimization, accumulate_grad_batches=2, gradient_clip_val, BatchNorm buffers;
     trainer.save_checkpoint at the end;
  2. resume from that checkpoint (ckpt_path=) for more steps;
  3. manual optimization (manual_backward -> Lightning's prepare_for_backward -> reducer._rebuild_buckets /
     reducer.prepare_for_backward), two synchronised micro-batches per step, clip_gradients;
  4. the same with static_graph=True (post_backward -> reducer._delay_all_reduce()).
Teardown of every fit reaches model._get_ddp_logging_data().
Each rank writes each run's final state_dicts to $OUT/<impl>.rank<r>.pt (checkpoints under $OUT/<impl>/); the test
compares them bit for bit. IMPL=lockstep,torch: eight fits in one process group, the last four with torch's DDP.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

torch.set_num_threads(1)
from common import OUT, RUNS, check_ddp_class, digits, make_model, out_path, save_result, switch_to  # noqa: E402

switch_to(RUNS[0])  # before Lightning is imported, as a script that calls use_as_torch_ddp() at its top

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

STRATEGY = os.environ.get("STRATEGY", "ddp")  # lockstep's run's; torch's is "ddp"
if STRATEGY.startswith("lockstep"):
    import lockstep.integrations.lightning  # noqa: F401  (registers "lockstep_ddp")


class Auto(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.seen_class = None

    def training_step(self, batch, batch_idx):
        if self.seen_class is None:
            self.seen_class = check_ddp_class(self.trainer.strategy.model)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Manual(Auto):
    """Manual optimization: two micro-batches per step, each backward synchronised (loss / 2)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        if self.seen_class is None:
            self.seen_class = check_ddp_class(self.trainer.strategy.model)
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        return loss


def loader():
    x, y = digits(512)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


def make_strategy(strategy, **ddp_kwargs):
    if not ddp_kwargs:
        return strategy
    if strategy == "lockstep_ddp":
        return lockstep.integrations.lightning.LockstepDDPStrategy(**ddp_kwargs)
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(**ddp_kwargs)


def trainer(strategy, **kw):
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        deterministic=True,
        **kw,
    )


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def run(impl: str) -> None:
    switch_to(impl)
    strategy = STRATEGY if impl == "lockstep" else "ddp"
    pl.seed_everything(0, workers=True)
    ckpt_dir = os.path.join(OUT, impl)
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, "auto.ckpt")

    # 1. automatic optimization with gradient accumulation and clipping
    model = Auto()
    t1 = trainer(strategy, max_steps=6, accumulate_grad_batches=2, gradient_clip_val=0.5)
    t1.fit(model, loader())
    t1.save_checkpoint(ckpt)
    result = {f"auto.{k}": v for k, v in state(model).items()}

    # 2. resume from the checkpoint
    model2 = Auto()
    t2 = trainer(strategy, max_steps=10, accumulate_grad_batches=2, gradient_clip_val=0.5)
    t2.fit(model2, loader(), ckpt_path=ckpt)
    result.update({f"resumed.{k}": v for k, v in state(model2).items()})
    # loading the checkpoint back into a fresh module gives fit 1's end state
    loaded = Auto.load_from_checkpoint(ckpt)
    # parameters only: the checkpoint holds rank 0's BatchNorm statistics, rank 1's own differ (as with torch)
    load_ok = all(torch.equal(p, result[f"auto.{k}"]) for k, p in loaded.named_parameters())

    # 3. manual optimization
    model3 = Manual()
    t3 = trainer(strategy, max_steps=8)
    t3.fit(model3, loader())
    result.update({f"manual.{k}": v for k, v in state(model3).items()})

    # 4. manual optimization with static_graph=True (Lightning calls reducer._delay_all_reduce() once)
    model4 = Manual()
    t4 = trainer(make_strategy(strategy, static_graph=True), max_steps=8)
    t4.fit(model4, loader())
    result.update({f"manual_static.{k}": v for k, v in state(model4).items()})

    rank = t3.global_rank
    classes = [m.seen_class for m in (model, model2, model3, model4)]
    report = {"class": classes, "load_ok": load_ok, "strategy": strategy}
    if rank == 0:
        print("REPORT", impl, report, flush=True)
    save_result(out_path(impl, f".rank{rank}.pt"), {**result, "__report__": report})


def main() -> None:
    for impl in RUNS:
        run(impl)


if __name__ == "__main__":
    main()
