"""``DistributedDataParallel.overlap_optimizer_step``: the optimizer stepped per bucket in the next forward.

At 2 gloo ranks the parameters after training equal, bit for bit, lockstep's plain DDP with the same optimizer
(SGD, momentum, Adam, AdamW; foreach on and off), with zero_grad before the forward or after the step, an LR
scheduler stepped after each step (the deferred update must use the step's learning rate, not the next one), an
eval forward and a ``no_sync`` accumulation in the loop, and a state_dict read between steps. The launch sequence
is agreed and really reordered (the first layers' bucket first after the ones sent during backward), the updates
happen in the forward (a parameter read right after ``opt.step()`` still holds the old value; after
``finish_step()`` the new), and a missing gradient raises on every rank before any update. One spawned group.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks

from lockstep import DistributedDataParallel
from lockstep.ddp.launch_order import priority_sequence

STEPS = 8
OPTIMIZERS = {
    "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, foreach=fe),
    "momentum": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                               foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=1e-3, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=fe),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


def _train(rank: int, opt_name: str, foreach: bool, overlap: bool, zero_first: bool, accumulate: bool):
    # 0.1 MB buckets: several, so the per-bucket updates and the reordered sequence are exercised.
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.1)
    opt = OPTIMIZERS[opt_name](model.parameters(), foreach)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    if overlap:
        opt = model.overlap_optimizer_step(opt)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        if zero_first:
            opt.zero_grad()
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        if accumulate and step % 3 == 1:
            with model.no_sync():
                F.cross_entropy(model(x[:8]), y[:8]).backward()
            x, y = x[8:], y[8:]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        if not zero_first:
            opt.zero_grad()
        if step == 3:
            with torch.no_grad():
                model.eval()
                model(x)
                model.train()
        if step == 5:
            model.state_dict()
            opt.state_dict()
    model.finish_step()
    return [p.detach().clone() for p in model.module.parameters()]


def _parity(rank: int) -> dict:
    out = {}
    for opt_name in OPTIMIZERS:
        for foreach in (False, True):
            for zero_first, accumulate in ((True, False), (False, True)):
                plain = _train(rank, opt_name, foreach, False, zero_first, accumulate)
                ours = _train(rank, opt_name, foreach, True, zero_first, accumulate)
                out[(opt_name, foreach, zero_first, accumulate)] = max(
                    (a - b).abs().max().item() for a, b in zip(plain, ours))
    return out


def _deferred(rank: int) -> dict:
    """What a script sees: the update lands in the next forward; the sequence is agreed and reordered."""
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = model.overlap_optimizer_step(opt, sent_during_backward_mb=0.3)
    first = model.module[0].weight
    g = torch.Generator().manual_seed(rank)
    seen = {}
    for step in range(6):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(16, 32, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
        before = first.detach().clone()
        opt.step()
        seen.setdefault("unchanged_after_step", []).append(torch.equal(before, first.detach()))
        if step == 4:
            model.finish_step()
            seen["changed_after_finish"] = not torch.equal(before, first.detach())
    # Only the first layer's forward: its bucket lands and it is stepped; the last layer's is still on the wire.
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(16, 32, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
    last = model.module[6].weight
    before_first, before_last = first.detach().clone(), last.detach().clone()
    opt.step()
    inside = []  # at the first layer's forward, inside the model's: (first stepped, last not yet, round in flight)
    probe = model.module[0].register_forward_pre_hook(lambda *_: inside.append((
        not torch.equal(before_first, first.detach()), torch.equal(before_last, last.detach()),
        model.reducer.strategy.round is not None)))
    model(torch.randn(2, 32, generator=g))
    probe.remove()
    seen["first_layer_alone"] = inside[0]
    seen["all_after_forward"] = not torch.equal(before_last, last.detach()) and model.reducer.strategy.round is None
    seen["sequence"] = model.reducer.strategy.sequence
    seen["num_buckets"] = len(model.reducer.buckets)
    events = model.reducer.events = []
    F.cross_entropy(model(torch.randn(16, 32, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
    seen["launches"] = [b for kind, b in events if kind == "launch"]
    model.reducer.events = None
    model.finish_step()
    return seen


def _missing(rank: int) -> str:
    """Rank 1 skips a layer: both ranks raise before any update, rank 0 (nothing missing) in its next forward."""
    class Skip(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()
            self.extra = torch.nn.Linear(4, 4)

        def forward(self, x, skip):
            out = self.body(x)
            return out if skip else self.extra(out)

    torch.manual_seed(0)
    model = DistributedDataParallel(Skip(), bucket_cap_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = model.overlap_optimizer_step(opt)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for _ in range(2):
        F.cross_entropy(model(x, False), y).backward()
        opt.step()
    before = None
    try:
        F.cross_entropy(model(x, rank == 1), y).backward()  # rank 1 raises here (its own gradient is missing)
        opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        model(x, False)  # rank 0 raises here, reading the flag before any update of that round
    except RuntimeError as error:
        model.reducer.strategy.finish()
        kept = before is None or all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return f"raised: {str(error)[:300]}" + ("" if kept else " (and a parameter was updated)")
    return "no error"


def _nonfinite(rank: int) -> dict:
    """detect_nonfinite=True: the same bits as the plain step; a NaN on rank 1 at step 4 raises on both ranks, and
    no parameter takes that step's update (the check's verdict rides in the last bucket, sent first after backward)."""
    out = {}
    for overlap in (False, True):
        model = DistributedDataParallel(_model(), bucket_cap_mb=0.1, detect_nonfinite=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if overlap:
            opt = model.overlap_optimizer_step(opt)
        g = torch.Generator().manual_seed(100 + rank)
        error, kept = "no error", None
        for step in range(6):
            opt.zero_grad()
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            if step == 4 and rank == 1:
                x[0, 0] = float("nan")
            try:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                if step == 4:
                    model(x)  # the overlapped step reads the verdict here
            except RuntimeError as e:
                error = type(e).__name__
                model.finish_step()
                kept = [p.detach().clone() for p in model.module.parameters()]
                break
        model.finish_step()
        out[overlap] = {"error": error, "params": kept}
    plain, ours = out[False]["params"], out[True]["params"]
    out["equal"] = plain is not None and ours is not None and all(torch.equal(a, b) for a, b in zip(plain, ours))
    out["errors"] = (out[False]["error"], out[True]["error"])
    return {k: out[k] for k in ("equal", "errors")}


class _Crash(Exception):
    pass


def _fit(directory: str, overlap_step, crash_at: int | None = None, resume: bool = False, **overrides):
    """The Trainer on a small classifier (SGD with momentum, warm-up, accumulation, eval, checkpoints)."""
    from torch.utils.data import TensorDataset

    from lockstep import Trainer, TrainerConfig

    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 32, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def crash(trainer):
        if trainer.step == crash_at:
            raise _Crash()

    settings = dict(epochs=2, batch_size=8, grad_accum_steps=2, warmup_steps=3, seed=1, checkpoint_dir=directory,
                    save_every_steps=2, progress=False, overlap_step=overlap_step, resume=resume)
    settings.update(overrides)
    trainer = Trainer(model, opt, F.cross_entropy, data, data, TrainerConfig(**settings),
                      on_step_end=crash if crash_at else None)
    try:
        trainer.fit()
    except _Crash:
        pass
    return trainer.overlapped, [p.detach().clone() for p in model.parameters()]


def _trainer(rank: int) -> dict:
    import shutil
    import tempfile

    import torch.distributed as dist

    out = {}
    tmp = os.path.join(tempfile.gettempdir(), f"lockstep-overlap-{os.getppid()}")  # both ranks': one parent
    try:
        base = os.path.join(tmp, "run-")  # each case its own checkpoint folder, shared by the ranks
        plain_on, plain = _fit(base + "plain", False)
        ours_on, ours = _fit(base + "ours", None)
        _fit(base + "crash", None, crash_at=5)
        resumed_on, resumed = _fit(base + "crash", None, resume=True)
        out["overlapped"] = (plain_on, ours_on, resumed_on)
        out["equal"] = all(torch.equal(a, b) for a, b in zip(plain, ours))
        out["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(plain, resumed))
        clipped_on, _ = _fit(base + "clip", None, grad_clip_norm=1.0, epochs=1)
        out["clipped_overlapped"] = clipped_on
        try:
            _fit(base + "forced", True, grad_clip_norm=1.0, epochs=1)
            out["forced"] = "no error"
        except ValueError as e:
            out["forced"] = str(e)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _split(rank: int) -> dict:
    """With the default cap, a model whose gradients fit one 25 MB bucket is rebuilt into several (so there is a
    first layers' bucket to send first); an explicit cap is the user's."""
    out = {}
    for overlap, cap in ((False, None), (True, None), (True, 20)):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(384, 384) for _ in range(8)]),
                                        bucket_cap_mb=cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if overlap:
            opt = model.overlap_optimizer_step(opt)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 384)).sum().backward()
            opt.step()
        model.finish_step()
        out[(overlap, cap)] = len(model.reducer.buckets)
    return out


def _binding(rank: int) -> dict:
    """One binding, no method replaced on the user's optimizer: the object returned is the one the loop steps; the
    user's own, stepped directly while bound, raises in one line before touching anything (every rank alike)."""
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.1)
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    before = set(vars(mine))
    opt = model.overlap_optimizer_step(mine)
    out = {"added": sorted(set(vars(mine)) - before), "shared": opt.param_groups is mine.param_groups,
           "same_state": opt.state is mine.state, "is_optimizer": isinstance(opt, torch.optim.Optimizer)}
    F.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 4, (16,))).backward()
    first = [p.detach().clone() for p in model.parameters()]
    try:
        mine.step()
        out["direct"] = "no error"
    except RuntimeError as error:
        out["direct"] = str(error)
    out["untouched"] = all(torch.equal(a, p) for a, p in zip(first, model.parameters()))
    opt.step()
    model.finish_step()
    out["stepped"] = not all(torch.equal(a, p) for a, p in zip(first, model.parameters()))
    try:
        model.overlap_optimizer_step(mine)
        out["twice"] = "no error"
    except RuntimeError as error:
        out["twice"] = str(error)
    return out


def _case(rank: int, world_size: int) -> dict:
    return {"parity": _parity(rank), "deferred": _deferred(rank), "missing": _missing(rank),
            "nonfinite": _nonfinite(rank), "trainer": _trainer(rank), "split": _split(rank), "binding": _binding(rank)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_case, 2, timeout_s=300)


def test_parameters_equal_the_plain_step_bit_for_bit(results):
    for rank_result in results:
        bad = {k: v for k, v in rank_result["parity"].items() if v != 0.0}
        assert not bad, f"max |plain - overlapped| per (optimizer, foreach, zero_grad first, no_sync): {bad}"
        assert len(rank_result["parity"]) == 16


def test_one_binding_the_users_optimizer_keeps_its_methods_and_refuses_a_direct_step(results):
    for rank_result in results:
        seen = rank_result["binding"]
        assert seen["added"] == ["_optimizer_step_pre_hooks"] or seen["added"] == [], seen  # a hook, no method
        assert seen["shared"] and seen["same_state"] and seen["is_optimizer"], seen
        assert seen["direct"] == ("SGD.step() was called on the optimizer given to overlap_optimizer_step; step the "
                                  "optimizer it returned (its .grad may still be on the wire until then): opt = "
                                  "model.overlap_optimizer_step(opt)"), seen
        assert seen["untouched"] and seen["stepped"], seen
        assert seen["twice"].startswith("overlap_optimizer_step: a strategy is bound already (overlapped step; "), seen


def test_the_update_lands_in_the_next_forward(results):
    for rank_result in results:
        seen = rank_result["deferred"]
        # Steps 0 and 1: the first round is finished in full (the bucket rebuild comes where torch's does), so
        # opt.step() steps at once; later rounds are deferred and the parameter moves only in the next forward.
        assert seen["unchanged_after_step"][0] is False
        assert all(seen["unchanged_after_step"][1:]), seen["unchanged_after_step"]
        assert seen["changed_after_finish"]
        # (first layer stepped, last layer not yet, the round still in flight)
        assert seen["first_layer_alone"] == (True, True, True), seen["first_layer_alone"]
        assert seen["all_after_forward"]  # the forward's end finishes the round


def test_the_launch_sequence_sends_the_first_layers_first_after_backward(results):
    sequences = [r["deferred"]["sequence"] for r in results]
    assert sequences[0] == sequences[1]
    n = results[0]["deferred"]["num_buckets"]
    assert n >= 3
    assert sequences[0] == priority_sequence(n, sequences[0].index(n - 1))
    assert sequences[0].index(n - 1) < n - 1  # really reordered: the last bucket is not launched last
    assert results[0]["deferred"]["launches"] == sequences[0]


def test_a_missing_gradient_raises_on_every_rank_before_the_update(results):
    for rank_result in results:
        assert rank_result["missing"].startswith("raised: "), rank_result["missing"]
        assert "extra.weight" in rank_result["missing"]
        assert "was updated" not in rank_result["missing"]


def test_a_nonfinite_gradient_raises_on_every_rank_before_the_update(results):
    for rank_result in results:
        seen = rank_result["nonfinite"]
        assert seen["errors"] == ("NonfiniteGradientError", "NonfiniteGradientError"), seen
        assert seen["equal"], "the parameters where the plain and the overlapped runs raised differ"


def test_the_trainer_overlaps_by_default_where_exact(results):
    for rank_result in results:
        seen = rank_result["trainer"]
        assert seen["overlapped"] == (False, True, True)
        assert seen["equal"], "the Trainer's parameters with and without the overlapped step differ"
        assert seen["resumed_equal"], "a crash and resume with the overlapped step differs from the plain run"
        assert seen["clipped_overlapped"] is False
        assert seen["forced"] == ("TrainerConfig.overlap_step=True: grad_clip_norm needs every gradient before any "
                                  "update")


def test_the_default_cap_is_split_so_there_is_a_first_bucket_to_send_first(results):
    for rank_result in results:
        counts = rank_result["split"]
        assert counts[(False, None)] == 1 and counts[(True, 20)] == 1, counts  # 4.7 MB: one bucket at 25 or 20 MB
        assert counts[(True, None)] >= 4, counts


def test_priority_sequence():
    assert priority_sequence(5, 2) == [0, 1, 4, 3, 2]
    assert priority_sequence(5, 5) == [0, 1, 2, 3, 4]
    assert priority_sequence(5, 0) == [0, 4, 3, 2, 1]
    assert priority_sequence(1, 3) == [0]
