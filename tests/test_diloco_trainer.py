"""The Trainer with DiLoCo (``TrainerConfig(diloco_sync_every=H)``) on 2 real gloo ranks, one rank a node.

One group runs: a straight run of 14 optimizer steps (2 synchronous warm-up steps, then H = 4, streaming with 2
fragments, dropout on: each rank's RNG matters); the same run crashed after step 7 and resumed from its checkpoint
of step 6 (``save_every_steps=3``; fragment 0 in flight there: launched after 6, landing after 7); the metrics
lines; the synced copies equal on every rank.
Asserted: the resumed run's parameters and synced copies equal the straight run's bit for bit, on each rank;
then a 1-rank group resumes the 2-rank checkpoint (another world size: it starts from the synced copy).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_utils import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

from lockstep import Trainer, TrainerConfig

N_TRAIN, N_EVAL = 240, 37
# 2 warm-up steps (averaged after each), then fragment 1 launched after steps 4, 8, 12 and fragment 0 after 6, 10,
# 14, each landing one step later: the checkpoint of step 6 holds fragment 0 in flight
DILOCO = dict(diloco_sync_every=4, diloco_fragments=2, diloco_wire_dtype="bf16", diloco_warmup_steps=2)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


class Crash(Exception):
    pass


def _train(directory: str, max_steps: int, resume: bool = False, crash_at: int | None = None, seed: int = 1):
    torch.manual_seed(seed + 1000 * int(os.environ.get("RANK", "0")))  # different starts: the broadcasts align them
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = TrainerConfig(epochs=2, batch_size=8, seed=3, checkpoint_dir=directory, save_every_steps=3,
                           keep_last=5, progress=False, max_steps=max_steps, resume=resume, log_every_steps=1,
                           metrics_path=os.path.join(directory, "metrics.jsonl"), **DILOCO)

    def crash(trainer):
        if trainer.step == crash_at:
            raise Crash(f"after step {crash_at}")

    trainer = Trainer(model, optimizer, nn.functional.cross_entropy, _data(N_TRAIN, 0), _data(N_EVAL, 1), config,
                      on_step_end=crash if crash_at else None)
    try:
        trainer.fit()
    except Crash:
        pass
    return trainer


def _state(trainer) -> dict:
    return {"params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]),
            "anchors": torch.cat([a.clone() for a in trainer.diloco.anchors]), "step": trainer.step,
            "inner_step": trainer.diloco.inner_step, "eval": trainer.evaluate()["eval_loss"]}


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    torch.set_num_threads(1)
    straight = _state(_train(os.path.join(root, "straight"), 14))
    crashed = _train(os.path.join(root, "resumed"), 14, crash_at=7)
    in_flight = len(crashed.diloco.in_flight)
    resumed_trainer = _train(os.path.join(root, "resumed"), 14, resume=True, seed=50)
    resumed = _state(resumed_trainer)
    lines = []
    if rank == 0:
        with open(os.path.join(root, "straight", "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
    return {"straight": straight, "resumed": resumed, "in_flight_at_crash": in_flight, "metrics": lines,
            "resumed_from": str(resumed_trainer.resumed_from), "ddp_world": resumed_trainer.ddp.world_size
            if hasattr(resumed_trainer.ddp, "world_size") else None}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("diloco_trainer")
    results = run_ranks(_scenarios, world_size=2, args=(str(root),), timeout_s=240)
    results[0]["root"] = str(root)
    return results


def test_resume_is_bit_for_bit(ranks):
    for r in ranks:
        assert r["resumed_from"].endswith("ckpt-000000006.pt")
        assert r["straight"]["step"] == r["resumed"]["step"] == 14
        assert r["straight"]["inner_step"] == r["resumed"]["inner_step"] == 14
        assert torch.equal(r["straight"]["params"], r["resumed"]["params"])
        assert torch.equal(r["straight"]["anchors"], r["resumed"]["anchors"])
    assert ranks[0]["in_flight_at_crash"] == 0  # the crash came after step 7's landing


def test_replicas_agree_on_the_synced_copy(ranks):
    assert torch.equal(ranks[0]["straight"]["anchors"], ranks[1]["straight"]["anchors"])
    assert not torch.equal(ranks[0]["straight"]["params"], ranks[1]["straight"]["params"])  # their own, between syncs
    assert ranks[0]["straight"]["eval"] == ranks[1]["straight"]["eval"]  # evaluated on the synced copy


def test_metrics_name_the_last_sync(ranks):
    train = [line for line in ranks[0]["metrics"] if line.get("event") == "train"]
    by_step = {line["step"]: line for line in train}
    assert by_step[1]["diloco_last_sync_step"] == 1 and by_step[2]["diloco_last_sync_step"] == 2  # the warm-up
    assert by_step[3]["diloco_last_sync_step"] == 2 and by_step[4]["diloco_last_sync_step"] == 2
    assert by_step[5]["diloco_last_sync_step"] == 5  # fragment 1: launched after 4, landed after 5
    assert by_step[7]["diloco_last_sync_step"] == 7  # fragment 0: launched after 6, landed after 7
    assert by_step[14]["diloco_last_sync_step"] == 13
    assert all(line["diloco_last_sync_s"] >= 0 for line in train if "diloco_last_sync_s" in line)
    assert by_step[14]["diloco_wire_nbytes"] > 0


def _resume_at_one_rank(rank: int, world_size: int, root: str) -> dict:
    trainer = _train(os.path.join(root, "straight"), 18, resume=True)
    return {"resized_from": trainer.resized_from, "step": trainer.step, "inner_step": trainer.diloco.inner_step}


def test_resume_at_one_rank(ranks):
    [one] = run_ranks(_resume_at_one_rank, world_size=1, args=(ranks[0]["root"],))
    assert one == {"resized_from": 2, "step": 18, "inner_step": 18}


@pytest.mark.parametrize("kwargs, message", [
    (dict(diloco_sync_every=0), "TrainerConfig.diloco_sync_every must be an int >= 1, got 0"),
    (dict(diloco_sync_every=10, diloco_wire_dtype="int4"), "TrainerConfig.diloco_wire_dtype must be one of"),
    (dict(diloco_sync_every=10, diloco_fragments=11), "TrainerConfig.diloco_fragments=11 must be <= sync_every=10"),
    (dict(diloco_sync_every=10, diloco_warmup_steps=-5), "TrainerConfig.diloco_warmup_steps must be an int >= 0"),
    (dict(diloco_sync_every=10, zero=1), "TrainerConfig.diloco_sync_every excludes TrainerConfig.zero"),
    (dict(diloco_sync_every=10, check_replicas_every=5), "excludes TrainerConfig.check_replicas_every"),
])
def test_config_refuses(kwargs, message):
    with pytest.raises(ValueError) as info:
        TrainerConfig(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
