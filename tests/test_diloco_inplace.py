"""DiLoCo under in-place recovery (issue #44 item 2): a lost node costs at most the inner steps since the last outer
sync, the survivors go on in their processes, and a node that comes back joins at the next sync.

The Trainer commits a DiLoCo step after the outer all-reduce and before the outer step (train/trainer.py), and
keeps each rank's state at the last sync point (train/diloco.py's ``snapshot``): a failure anywhere between two
syncs, in the outer all-reduce included, takes every survivor back there. The runs are
tests/launch_scripts/inplace_train.py's (AdamW inside, LR warm-up, 2 epochs of 6 steps) on loopback, as
test_inplace_loopback.py's; the runs they are compared with are forked (tests/script_ranks.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from test_inplace_loopback import INPLACE, _finish, _reference, _rows, _start_ranks, _without_cxx_frames
from test_multinode import clean_env

from lockstep.process_group import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
H = 4  # the outer sync every 4 steps: after steps 4, 8 and 12 of the 12
STEPS, N = 12, 96


def _samples_kept(directory: str) -> tuple[dict[int, set[int]], list[int]]:
    """Each step's ids over every process's sample log, the steps a rewind undid dropped; and the steps rewound to.
    Asserts each epoch saw each sample once."""
    per_step: dict[int, set[int]] = {}
    epoch_of: dict[int, int] = {}
    rewinds = []
    for name in (n for n in os.listdir(directory) if n.startswith("samples-")):
        kept: list[dict] = []
        with open(os.path.join(directory, name)) as f:
            for rec in map(json.loads, f):
                if rec.get("event") == "rewind":
                    rewinds.append(rec["step"])
                    kept = [r for r in kept if r["step"] <= rec["step"]]
                elif "ids" in rec:
                    kept.append(rec)
        for rec in kept:
            per_step.setdefault(rec["step"], set()).update(rec["ids"])
            epoch_of[rec["step"]] = rec["epoch"]
    assert sorted(per_step) == list(range(1, STEPS + 1)), sorted(per_step)
    for epoch in set(epoch_of.values()):
        ids = [i for s, got in per_step.items() if epoch_of[s] == epoch for i in got]
        assert sorted(ids) == list(range(N)), f"epoch {epoch}: a sample twice or none"
    return per_step, sorted(rewinds)


def _assert_same_final(got_dir: str, want_dir: str) -> None:
    """The final checkpoints' model (rank 0's replica) and DiLoCo's synced copy and outer optimizer, bit for bit."""
    name = f"ckpt-{STEPS:09d}.pt"
    got, want = (torch.load(os.path.join(d, name), weights_only=False) for d in (got_dir, want_dir))
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    for a, b in zip(got["diloco"]["anchors"], want["diloco"]["anchors"], strict=True):
        assert torch.equal(a, b)
    momenta = [(s["momentum_buffer"], want["diloco"]["outer_optimizer"]["state"][k]["momentum_buffer"])
               for k, s in got["diloco"]["outer_optimizer"]["state"].items()]
    assert momenta and all(torch.equal(a, b) for a, b in momenta)


def _start_newcomer(directory: str, port: int, *extra: str) -> subprocess.Popen:
    """What ``lockstep launch`` starts on a node that comes back to a running in-place job (as
    test_inplace_loopback's, with the Trainer's script)."""
    join = json.dumps({"base": 2, "node": {"node_rank": 1, "addr": "127.0.0.1", "host": "loopback"},
                       "t0": time.time()})
    return subprocess.Popen([sys.executable, INPLACE, directory, *extra], cwd=HERE, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            env=clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCKSTEP_INPLACE="1",
                                          LOCKSTEP_INPLACE_JOIN=join))


def _wait_for(path: str, procs: list[subprocess.Popen], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"waiting for {what}: " + _without_cxx_frames(
            "\n".join(p.stdout.read() for p in dead if p.stdout is not None))
        time.sleep(0.1)


def test_a_node_lost_in_the_outer_all_reduce_costs_the_steps_since_the_last_sync_and_one_back_joins_at_the_next(
        tmp_path):
    """2 ranks, a sync every 4 steps. Rank 1 stops after step 7 and is killed while rank 0 waits for it in step 8's
    outer all-reduce: rank 0 goes back to step 4 (the last sync: its parameters the synced copy, its AdamW state and
    LR schedule as they were there), steps 5-7 are dealt again at world size 1, and it goes on alone in its process.
    A node started meanwhile waits until the next sync (after step 8) and is admitted there; it takes rank 0's
    state. Every epoch's samples once (the undone steps dropped), both exit 0, and the final model, synced copy and
    outer momentum equal, bit for bit, clean stops and resumes: 2 ranks to step 4, 1 to step 8, 2 to the end."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    for d in (grown, clean):
        os.makedirs(d)
    port = free_port()
    diloco = ("--diloco", str(H))
    procs = _start_ranks(INPLACE, 2, grown, *diloco, "--pause-at", "7", "--pause-rank", "1", "--hold-at-world", "1",
                         port=port)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference, INPLACE, 2, clean, *diloco, "--max-steps", "4")
        _wait_for(os.path.join(grown, "paused"), procs, "rank 1's pause after step 7")
        time.sleep(1.0)  # rank 0 is in step 8's outer all-reduce by now (its steps take milliseconds)
        procs[1].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not any(w == 1 for _, _, w, _ in _rows(grown)):  # rank 0 holds its first step at world size 1
            assert time.monotonic() < deadline and procs[0].poll() is None, _without_cxx_frames(procs[0].stdout.read())
            time.sleep(0.1)
        newcomer = _start_newcomer(grown, port, *diloco)
        assert _finish([*procs, newcomer], killed_ok=True) == [0, -signal.SIGKILL, 0]
        reference.result()
    rows = _rows(grown)
    survivor = procs[0].pid
    steps = [(s, w) for _, s, w, p in rows if p == survivor]
    # the lost steps: 5-7 (after the sync of step 4); at most H - 1 of them, however the loss falls
    assert steps == [(s, 2) for s in range(1, 8)] + [(s, 1) for s in range(5, 9)] + [(s, 2) for s in range(9, 13)], \
        steps
    assert [(s, w) for _, s, w, p in rows if p == newcomer.pid] == [(s, 2) for s in range(9, 13)]
    _, rewinds = _samples_kept(grown)
    assert rewinds == [4]
    for size, extra in ((1, ["--max-steps", "8"]), (2, [])):
        _reference(INPLACE, size, clean, *diloco, *extra)
    _assert_same_final(grown, clean)


def test_re_formations_between_syncs_go_back_to_the_last_and_change_nothing(tmp_path):
    """Rank 0 raises the in-place alarm after a step until the group re-formed 3 times (same size, same processes):
    each time every rank goes back to the last sync and does the steps since again, and the result equals, bit for
    bit, a run without alarms. A run resumed from a checkpoint between two syncs (step 6) and re-formed after its
    first step goes back to where it resumed (each rank's own parameters, not the synced copy): bit for bit too.
    Streaming DiLoCo with in-place recovery is refused in one line naming the field."""
    alarmed, quiet, streaming, resumed = (str(tmp_path / name) for name in ("alarmed", "quiet", "streaming",
                                                                            "resumed"))
    for d in (alarmed, quiet, streaming, resumed):
        os.makedirs(d)
    diloco = ("--diloco", str(H))
    procs = _start_ranks(INPLACE, 2, alarmed, *diloco, "--alarms", "3", "--step-sleep", "0.5")
    refused = _start_ranks(INPLACE, 1, streaming, *diloco, "--diloco-fragments", "2")
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference, INPLACE, 2, quiet, *diloco)
        _reference(INPLACE, 2, resumed, *diloco, "--max-steps", "6")
        again = _start_ranks(INPLACE, 2, resumed, *diloco, "--alarms", "1", "--step-sleep", "0.5")
        _finish(procs)
        out, _ = refused[0].communicate(timeout=300)
        _finish(again)
        reference.result()
    _, rewinds = _samples_kept(resumed)
    assert rewinds == [6, 6], rewinds  # both ranks, to where the run resumed
    _assert_same_final(resumed, quiet)
    assert refused[0].returncode == 1, out
    [line] = [line for line in out.splitlines() if "Error: TrainerConfig.diloco_fragments" in line]
    assert line.split(": ", 1)[1].startswith("ValueError: TrainerConfig.diloco_fragments=2 with in-place recovery: "
                                             "streaming syncs"), line
    _, rewinds = _samples_kept(alarmed)
    assert len(rewinds) >= 3 * 2 and set(rewinds) <= {0, 4, 8}, rewinds  # each rank, each re-formation: a sync step
    _assert_same_final(alarmed, quiet)
