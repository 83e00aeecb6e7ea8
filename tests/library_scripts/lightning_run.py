"""Lightning 2.6 on 2 CPU ranks with torch's DDP or lockstep's.

    IMPL=torch    STRATEGY=ddp          python lightning_run.py   # torch's DDP
    IMPL=lockstep STRATEGY=ddp          python lightning_run.py   # use_as_torch_ddp() (or LOCKSTEP_AS_TORCH_DDP=1)
    IMPL=lockstep STRATEGY=lockstep_ddp python lightning_run.py   # the registered strategy

Lightning's "ddp" launcher re-runs this script for rank 1 (popen). Three fits in one process group:
  1. automatic optimization, accumulate_grad_batches=2, gradient_clip_val, BatchNorm buffers;
     trainer.save_checkpoint at the end;
  2. resume from that checkpoint (ckpt_path=) for more steps;
  3. manual optimization (manual_backward -> Lightning's prepare_for_backward -> reducer._rebuild_buckets /
     reducer.prepare_for_backward), two synchronised micro-batches per step, clip_gradients;
  4. the same with static_graph=True (post_backward -> reducer._delay_all_reduce()).
Teardown of every fit reaches model._get_ddp_logging_data().
Each rank writes its final state_dicts to $OUT.rank<r>.pt; compare_results.py compares bit for bit.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

torch.set_num_threads(1)
from common import IMPL, check_ddp_class, digits, make_model, maybe_use_lockstep, save_result  # noqa: E402

maybe_use_lockstep()

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

STRATEGY = os.environ.get("STRATEGY", "ddp")
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


def make_strategy(**ddp_kwargs):
    if not ddp_kwargs:
        return STRATEGY
    if STRATEGY == "lockstep_ddp":
        return lockstep.integrations.lightning.LockstepDDPStrategy(**ddp_kwargs)
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(**ddp_kwargs)


def trainer(strategy=None, **kw):
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or STRATEGY,
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


def main() -> None:
    out = os.environ.get("OUT", f"/tmp/lightning_{IMPL}_{STRATEGY}")
    pl.seed_everything(0, workers=True)
    ckpt_dir = os.environ.get("CKPT_DIR") or os.path.join(tempfile.gettempdir(), f"pl_{IMPL}_{STRATEGY}")
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, "auto.ckpt")

    # 1. automatic optimization with gradient accumulation and clipping
    model = Auto()
    t1 = trainer(max_steps=6, accumulate_grad_batches=2, gradient_clip_val=0.5)
    t1.fit(model, loader())
    t1.save_checkpoint(ckpt)
    result = {f"auto.{k}": v for k, v in state(model).items()}

    # 2. resume from the checkpoint
    model2 = Auto()
    t2 = trainer(max_steps=10, accumulate_grad_batches=2, gradient_clip_val=0.5)
    t2.fit(model2, loader(), ckpt_path=ckpt)
    result.update({f"resumed.{k}": v for k, v in state(model2).items()})
    # loading the checkpoint back into a fresh module gives fit 1's end state
    loaded = Auto.load_from_checkpoint(ckpt)
    # parameters only: the checkpoint holds rank 0's BatchNorm statistics, rank 1's own differ (as with torch)
    load_ok = all(torch.equal(p, result[f"auto.{k}"]) for k, p in loaded.named_parameters())

    # 3. manual optimization
    model3 = Manual()
    t3 = trainer(max_steps=8)
    t3.fit(model3, loader())
    result.update({f"manual.{k}": v for k, v in state(model3).items()})

    # 4. manual optimization with static_graph=True (Lightning calls reducer._delay_all_reduce() once)
    model4 = Manual()
    t4 = trainer(strategy=make_strategy(static_graph=True), max_steps=8)
    t4.fit(model4, loader())
    result.update({f"manual_static.{k}": v for k, v in state(model4).items()})

    rank = t3.global_rank
    report = {"class": [m.seen_class for m in (model, model2, model3, model4)], "load_ok": load_ok, "strategy": STRATEGY}
    if rank == 0:
        print("REPORT", report, flush=True)
    save_result(f"{out}.rank{rank}.pt", {**result, "__report__": report})


if __name__ == "__main__":
    main()
