"""The Trainer with ZeRO (``TrainerConfig.zero``, issue #36 item 4) on 2 real gloo ranks, one spawned group.

The bar is the plain Trainer: with zero=1 the parameters after every run equal, bit for bit, a plain AdamW's; a
crash resumes from the sharded checkpoint (one optimizer part a rank) exactly; the same checkpoint resumes at world
size 1 (rank 0 alone, ``group=``) exactly as a plain run resized the same way, and into a plain optimizer; the
merged parts are the plain optimizer's state dict at that step (``consolidated_optimizer_state``: what plain torch
loads). Old checkpoints' parts are pruned with them. zero=2 the same, and its parts load into zero=1 and plain.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from dist_utils import run_ranks
from lockstep import Trainer, TrainerConfig

N_TRAIN = 150
CRASH_AT = 7  # checkpoints every 3 steps: the crash loses step 7, the resume starts from step 6


class Crash(Exception):
    pass


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def _train(directory, zero=None, crash=False, resume=False, group=None, on_step_end=None):
    torch.manual_seed(1 + 1000 * dist.get_rank())  # DDP's broadcast aligns the replicas
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    def crash_hook(trainer):
        if crash and trainer.step == CRASH_AT:
            raise Crash
        if on_step_end is not None:
            on_step_end(trainer)

    cfg = TrainerConfig(epochs=3, batch_size=8, grad_accum_steps=2, warmup_steps=2, seed=3, zero=zero,
                        checkpoint_dir=str(directory), save_every_steps=3, keep_last=2, progress=False,
                        resume=resume)
    trainer = Trainer(model, optimizer, nn.functional.cross_entropy, _data(), None, cfg, group=group,
                      on_step_end=crash_hook)
    try:
        trainer.fit()
    except Crash:
        pass
    return trainer


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _scenarios(rank, world_size, root):
    from lockstep.train.zero import consolidated_optimizer_state

    out = {}
    path = lambda name: os.path.join(root, name)  # noqa: E731
    out["plain"] = _params(_train(path("plain")))
    zero1 = _train(path("zero1"), zero=1)
    out["zero1"] = _params(zero1)
    out["local_state"] = len(zero1.optimizer.optim.state)
    out["files"] = sorted(os.listdir(path("zero1")))
    _train(path("crash"), zero=1, crash=True)
    _train(path("plain_crash"), crash=True)
    dist.barrier()
    if rank == 0:  # the same checkpoints, for the world-size-1 resumes below
        for name in ("crash", "plain_crash"):
            shutil.copytree(path(name), path(name + "_w1"))
            shutil.copytree(path(name), path(name + "_into_plain_w1"))
        out["consolidated"] = consolidated_optimizer_state(os.path.join(path("crash"), "ckpt-000000006.pt"))
        out["plain_state"] = torch.load(os.path.join(path("plain_crash"), "ckpt-000000006.pt"),
                                        weights_only=True)["optimizer"]
    dist.barrier()
    out["resumed"] = _params(_train(path("crash"), zero=1, resume=True))
    # ZeRO-2: gradients and optimizer state in shards, the parameters all-gathered per bucket
    out["zero2"] = _params(_train(path("zero2"), zero=2))
    _train(path("crash2"), zero=2, crash=True)
    dist.barrier()
    if rank == 0:
        for into in ("_w1", "_into_plain_w1", "_into_zero1"):
            shutil.copytree(path("crash2"), path("crash2" + into))
        out["consolidated2"] = consolidated_optimizer_state(os.path.join(path("crash2"), "ckpt-000000006.pt"))
    dist.barrier()
    out["resumed2"] = _params(_train(path("crash2"), zero=2, resume=True))
    out["zero2_into_zero1"] = _params(_train(path("crash2_into_zero1"), zero=1, resume=True))
    alone = dist.new_group([0])  # every rank calls new_group; rank 0 resumes alone in it
    if rank == 0:
        out["w1_zero"] = _params(_train(path("crash_w1"), zero=1, resume=True, group=alone))
        out["w1_plain_ref"] = _params(_train(path("plain_crash_w1"), resume=True, group=alone))
        out["w1_into_plain"] = _params(_train(path("crash_into_plain_w1"), resume=True, group=alone))
        out["w1_zero2"] = _params(_train(path("crash2_w1"), zero=2, resume=True, group=alone))
        out["w1_zero2_into_plain"] = _params(_train(path("crash2_into_plain_w1"), resume=True, group=alone))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_scenarios, world_size=2, args=(str(tmp_path_factory.mktemp("zero")),), timeout_s=300)


def _same(xs, ys):
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_zero1_trains_the_plain_optimizers_bits_with_its_state_sharded(results):
    for r in results:
        assert _same(r["zero1"], r["plain"])
    # torch's greedy partition of 192, 96, 32 and 3 elements: 1 tensor on rank 0, 3 on rank 1; none holds all 4
    assert [r["local_state"] for r in results] == [1, 3]


def test_a_zero_checkpoint_is_one_part_a_rank_and_old_parts_are_pruned(results):
    files = results[0]["files"]
    checkpoints = [f for f in files if f.endswith(".pt") and ".optim-" not in f]
    assert len(checkpoints) == 2, files  # keep_last
    for ckpt in checkpoints:
        stem = ckpt.removesuffix(".pt")
        assert {f"{stem}.optim-r0-of-2.pt", f"{stem}.optim-r1-of-2.pt"} <= set(files), files
    assert len([f for f in files if ".optim-r" in f and f.endswith(".pt")]) == 4, files


def test_a_crashed_zero_run_resumes_exactly(results):
    for r in results:
        assert _same(r["resumed"], r["plain"])


def test_the_parts_merge_into_the_plain_optimizers_state_dict(results):
    merged, plain = results[0]["consolidated"], results[0]["plain_state"]
    assert merged["param_groups"] == plain["param_groups"]
    assert merged["state"].keys() == plain["state"].keys()
    for index, state in plain["state"].items():
        assert state.keys() == merged["state"][index].keys()
        assert all(torch.equal(v, merged["state"][index][k]) for k, v in state.items()), index


def test_a_zero_checkpoint_resumes_at_another_world_size_sharded_or_plain(results):
    r = results[0]
    assert _same(r["w1_zero"], r["w1_plain_ref"])
    assert _same(r["w1_into_plain"], r["w1_plain_ref"])


@pytest.mark.parametrize("value", [3, True, "1"])
def test_zero_must_be_a_stage(value):
    with pytest.raises(ValueError, match=r"TrainerConfig.zero must be None, 1 or 2 \(the ZeRO stage\), got"):
        TrainerConfig(zero=value)
    with pytest.raises(ValueError, match="TrainerConfig.zero and TrainerConfig.overlap_step=True exclude"):
        TrainerConfig(zero=1, overlap_step=True)


def test_zero2_trains_resumes_and_reshards_with_the_plain_optimizers_bits(results):
    for r in results:
        assert _same(r["zero2"], r["plain"])
        assert _same(r["resumed2"], r["plain"])  # its own part at the same world size
        assert _same(r["zero2_into_zero1"], r["plain"])  # every part merged, into the other stage
    r = results[0]
    assert _same(r["w1_zero2"], r["w1_plain_ref"])  # world 2 -> 1
    assert _same(r["w1_zero2_into_plain"], r["w1_plain_ref"])


def test_zero2_parts_merge_into_the_plain_optimizers_state_dict(results):
    merged, plain = results[0]["consolidated2"], results[0]["plain_state"]
    assert merged["state"].keys() == plain["state"].keys()
    for index, state in plain["state"].items():
        assert state.keys() == merged["state"][index].keys()
        assert all(torch.equal(v, merged["state"][index][k]) for k, v in state.items()), index
    assert [{k: v for k, v in g.items() if k != "params"} for g in merged["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in plain["param_groups"]]


def _killed_worker(directory, marker):
    """One rank under torch's elastic agent (lockstep launch --max-restarts 1): rank 1 is SIGKILLed after step 7
    of the first attempt, between two checkpoints; the restarted group resumes from its ZeRO-2 parts."""
    import signal

    import lockstep

    torch.set_num_threads(1)  # as in run_ranks: the reference run's numerics
    env = lockstep.init(backend="gloo")
    first_attempt = not os.path.exists(marker)

    def die(trainer):
        if first_attempt and trainer.step == CRASH_AT and env.rank == 1:
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: the process is gone

    try:
        trainer = _train(directory, zero=2, resume=True, on_step_end=die)
        return {"params": _params(trainer), "resumed_from": str(trainer.resumed_from), "first": first_attempt}
    finally:
        lockstep.shutdown()


def test_a_zero2_run_killed_with_sigkill_resumes_bit_for_bit(results, tmp_path):
    from lockstep.launch.launcher import launch_function

    marker = str(tmp_path / "killed-once")
    finals = launch_function(_killed_worker, args=(str(tmp_path / "k"), marker), nproc_per_node=2, max_restarts=1)
    assert os.path.exists(marker)  # the kill happened
    for rank in range(2):
        assert not finals[rank]["first"]  # these results come from the restarted attempt
        assert finals[rank]["resumed_from"].endswith("ckpt-000000006.pt")
        assert _same(finals[rank]["params"], results[rank]["plain"]), f"rank {rank} diverged after the restart"
