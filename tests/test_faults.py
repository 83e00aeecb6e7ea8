"""Real faults under `lockstep launch`: kill -9 at chosen points, preemption by SIGTERM, a rank that fails or leaves.

Every run is the Trainer in tests/fault_scripts/train.py on 2 gloo workers (15 steps, a
checkpoint every 2), under `lockstep launch`, but for the two that the others are compared
with (the uninterrupted reference and the preemption's last resume: about the Trainer, not
the launcher), whose ranks are forked from tests/dist_utils.py's forkserver
(tests/script_ranks.py). A kill run sets LOCKSTEP_TEST_KILL_AT (lockstep.train.faults) so one
worker SIGKILLs itself at an exact point: inside forward, inside backward with a bucket's
all-reduce in flight, after the optimizer's update, or while rank 0 writes a checkpoint
(temporary just opened, 64 KiB written, written but not renamed, renamed without its
checksum file). `--max-restarts` brings the group back, it resumes from the newest good
checkpoint, and the finished run must equal an uninterrupted one bit for bit: parameters,
optimizer state, sampler position; and the per-step sample ids, attempt by attempt, must
show no step skipped and every step's data equal to the uninterrupted run's.

Cost: each kill run starts 5 processes that import torch (~15-20 s on 2 idle cores, more
under load); a launch costs ~7 CPU-s, a forked run ~1. The default run draws
LOCKSTEP_KILL_RUNS=2 points (one in training, one in a checkpoint write);
LOCKSTEP_KILL_RUNS=10 draws every phase at least once (a release, or a change to checkpoints).
LOCKSTEP_KILL_SEED picks the draw (printed; default fixed).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from levels import FULL, full_only
import torch
from script_ranks import run_script

from lockstep.train.faults import PHASES

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_scripts", "train.py")
KILL_RUNS = int(os.environ.get("LOCKSTEP_KILL_RUNS", "2"))
KILL_SEED = int(os.environ.get("LOCKSTEP_KILL_SEED", "20261135"))  # default: backward, then ckpt_write
STEPS, SAVE_STEPS, N_TRAIN = 15, [2, 4, 6, 8, 10, 12, 14, 15], 150
MAX_RESTARTS = 2
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_RESTART_COUNT")

pytestmark = pytest.mark.timeout(400 + 60 * KILL_RUNS)


def draw_kill_points(seed: int, n: int) -> list[str]:
    """n kill points: first one in training and one in a checkpoint write, then every other phase, then any."""
    rng = random.Random(seed)
    train, ckpt = [p for p in PHASES if not p.startswith("ckpt")], [p for p in PHASES if p.startswith("ckpt")]
    first = [rng.choice(train), rng.choice(ckpt)]
    rest = [p for p in PHASES if p not in first]
    rng.shuffle(rest)
    count = max(n, 10)  # the same draw whatever n: the default run's points are the first of CI's ten
    phases = (first + rest + [rng.choice(PHASES) for _ in range(count)])[:count]
    points = []
    for phase in phases:
        if phase.startswith("ckpt"):  # only global rank 0 writes, at the steps that save
            points.append(f"step={rng.choice(SAVE_STEPS)},phase={phase},rank=0")
        else:
            points.append(f"step={rng.randint(1, STEPS)},phase={phase},rank={rng.randint(0, 1)}")
    return points[:n]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    env.pop("LOCKSTEP_TEST_KILL_AT", None)
    env.update(extra)
    return env


def launch(directory, *script_args, max_restarts=0, env=None, signal_when=None, timeout_s=300.0):
    """Run `python -m lockstep launch` on the fault script; ``signal_when=(pattern, pid_fn)`` sends SIGTERM
    to ``pid_fn(launcher, stdout line)`` the first time a stdout line matches ``pattern``."""
    os.makedirs(directory, exist_ok=True)
    command = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", "--max-restarts",
               str(max_restarts), SCRIPT, str(directory), *script_args]
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or clean_env(), cwd=HERE)
    out_lines = []
    try:
        if signal_when is not None:
            pattern, pid_fn = signal_when
            for line in proc.stdout:
                out_lines.append(line)
                if re.search(pattern, line):
                    os.kill(pid_fn(proc, line), signal.SIGTERM)
                    break
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    return {"rc": proc.returncode, "out": "".join(out_lines) + out, "err": err, "elapsed_s": time.monotonic() - start,
            "dir": str(directory)}


def run_forked(directory, *script_args):
    """The fault script on 2 ranks forked from the forkserver, not launched: for the runs the others are compared
    with ("rc" is 0 when every rank finished)."""
    os.makedirs(directory, exist_ok=True)
    start = time.monotonic()
    done = run_script(SCRIPT, 2, str(directory), *script_args, log_dir=str(directory), timeout_s=300,
                      drop=("LOCKSTEP_TEST_KILL_AT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))
    return {**done, "elapsed_s": time.monotonic() - start, "dir": str(directory)}


def _preemption_chain(root):
    """A: SIGTERM to worker rank 1; B: resume, SIGTERM to the launcher; C: resume to the end (forked)."""
    d = os.path.join(root, "preempt")
    a = launch(d, "--step-sleep", "0.3",
               signal_when=(r"step 3 done rank=1 ", lambda proc, line: int(re.search(r"pid=(\d+)", line)[1])))
    b = launch(d, "--resume", "--step-sleep", "0.3", signal_when=(r"step 9 done rank=0 ", lambda proc, line: proc.pid))
    c = run_forked(d, "--resume")
    return {"a": a, "b": b, "c": c, "dir": d}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    points = draw_kill_points(KILL_SEED, KILL_RUNS)
    print(f"\nkill points (LOCKSTEP_KILL_SEED={KILL_SEED}, LOCKSTEP_KILL_RUNS={KILL_RUNS}): {points}")
    jobs = {"ref": lambda: run_forked(root / "ref")}
    for i, point in enumerate(points):
        jobs[f"kill{i}"] = (lambda i=i, point=point: launch(
            root / f"kill{i}", max_restarts=MAX_RESTARTS, env=clean_env(LOCKSTEP_TEST_KILL_AT=point)))
    jobs["preempt"] = lambda: _preemption_chain(str(root))
    if FULL:  # ~20 CPU-s: the launcher's side of both is tests/test_launch_reports.py's (raises.py, early_exit.py)
        jobs["raise_forward"] = lambda: launch(root / "raise", "--raise-in-forward", "4", timeout_s=120)
        jobs["exit_early"] = lambda: launch(root / "early", "--exit-early", "3", timeout_s=120)
    with ThreadPoolExecutor(max_workers=3) as pool:  # mostly start-up: worth overlapping even on 2 cores
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    results["points"] = points
    return results


# ---------------------------------------------------------------- what "identical" and "no data lost" mean


def final_state(directory, rank):
    return torch.load(os.path.join(directory, f"final-rank{rank}.pt"), weights_only=True)


def assert_same_state(directory, ref_directory, label):
    for rank in range(2):
        got, want = final_state(directory, rank), final_state(ref_directory, rank)
        assert got["step"] == want["step"] == STEPS, label
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"])), f"{label}: rank {rank} params"
        for key, state in want["optimizer"]["state"].items():
            for name, value in state.items():
                other = got["optimizer"]["state"][key][name]
                assert torch.equal(other, value) if torch.is_tensor(value) else other == value, \
                    f"{label}: rank {rank} optimizer state {key}.{name}"
        assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], label
        assert got["sampler"] == want["sampler"], f"{label}: rank {rank} sampler position"


def sample_lineage(directory, rank):
    """{step: (epoch, ids)} as the surviving attempts saw them; asserts each attempt ran contiguous steps from
    the step it resumed at, and that no attempt resumed past what the previous one had done (nothing skipped)."""
    attempts = []
    with open(os.path.join(directory, f"samples-rank{rank}.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "start":
                attempts.append((record["step"], []))
            else:
                attempts[-1][1].append(record)
    effective = {}
    for k, (start, records) in enumerate(attempts):
        assert [r["step"] for r in records] == list(range(start + 1, start + 1 + len(records))), (directory, k)
        if k:
            previous_start, previous = attempts[k - 1]
            assert start <= previous_start + len(previous), f"attempt {k} resumed at {start}: steps skipped"
        for r in records:
            effective[r["step"]] = (r["epoch"], r["ids"])
    return effective, attempts


def assert_same_data(directory, ref_directory, label):
    for rank in range(2):
        got, attempts = sample_lineage(directory, rank)
        want, _ = sample_lineage(ref_directory, rank)
        assert sorted(got) == list(range(1, STEPS + 1)), f"{label}: rank {rank} steps {sorted(got)}"
        assert got == want, f"{label}: rank {rank} saw other data than the uninterrupted run"
    return attempts


# ---------------------------------------------------------------- tests


def test_reference_run_sees_every_sample_once_per_epoch(runs):
    ref = runs["ref"]
    assert ref["rc"] == 0, ref["err"][-3000:]
    by_epoch = {}
    for rank in range(2):
        steps, attempts = sample_lineage(ref["dir"], rank)
        assert len(attempts) == 1 and sorted(steps) == list(range(1, STEPS + 1))
        for epoch, ids in steps.values():
            by_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(by_epoch) == [1, 2, 3]  # epochs count from 1 in every log (issue 28, item 8)
    for epoch, ids in by_epoch.items():
        assert sorted(ids) == list(range(N_TRAIN)), f"epoch {epoch}"  # 150 over 2 ranks: no padding


def test_kill_9_at_random_points_resumes_bit_identically(runs):
    """The bar: every drawn kill point (10 of 10 with LOCKSTEP_KILL_RUNS=10) ends identical to the reference."""
    passed = []
    for i, point in enumerate(runs["points"]):
        run = runs[f"kill{i}"]
        label = f"kill point {point} (seed {KILL_SEED})"
        assert run["rc"] == 0, f"{label}: launcher exit {run['rc']}\n{run['err'][-3000:]}"
        assert f"lockstep test: SIGKILL at {point},attempt=0" in run["err"], f"{label}: the kill did not happen"
        assert "restarting the workers (restart 1 of" in run["err"], label
        assert_same_state(run["dir"], runs["ref"]["dir"], label)
        attempts = assert_same_data(run["dir"], runs["ref"]["dir"], label)
        assert len(attempts) == 2, label
        if "phase=ckpt_meta" in point:  # renamed without its checksum file: skipped on resume, with a warning
            step = int(re.search(r"step=(\d+)", point)[1])
            assert "skipping checkpoint" in run["err"] and f"ckpt-{step:09d}.pt: no metadata file" in run["err"], label
        assert not [n for n in os.listdir(os.path.join(run["dir"], "ckpt")) if ".tmp-" in n], label
        passed.append((point, round(run["elapsed_s"], 1)))
    print(f"\n{len(passed)} of {len(runs['points'])} kill runs identical to the uninterrupted run: {passed}")


def test_sigterm_preempts_checkpoints_and_exits_75_then_resumes_exactly(runs):
    chain = runs["preempt"]
    a, b, c = chain["a"], chain["b"], chain["c"]
    # A: SIGTERM to one worker: both ranks stop after the same step, checkpoint, exit 75; the launcher passes 75 on
    assert a["rc"] == 75, a["err"][-3000:]
    stops = set(re.findall(r"rank (\d) preempted: stopped after step (\d+)", a["err"]))  # the report repeats lines
    assert sorted(r for r, _ in stops) == ["0", "1"] and len({s for _, s in stops}) == 1, stops
    stop_a = int(stops.pop()[1])
    assert 3 <= stop_a <= 5  # at most two steps after the signal (the flag is agreed one step later)
    assert "the workers were preempted (SIGTERM) after writing a checkpoint" in a["err"]
    # B: SIGTERM to the launcher: its agent forwards it; every worker checkpoints; exit 75
    assert b["rc"] == 75, b["err"][-3000:]
    stops_b = {int(s) for _, s in re.findall(r"rank (\d) preempted: stopped after step (\d+)", b["err"])}
    assert len(stops_b) == 1 and 9 <= stops_b.pop() <= 11, b["err"][-2000:]
    assert "stopped by SIGTERM; every worker here (rank0, rank1) finished its step and wrote a checkpoint" in b["err"]
    # C: the resumed job ends as the uninterrupted one did
    assert c["rc"] == 0, c["err"][-3000:]
    assert_same_state(chain["dir"], runs["ref"]["dir"], "preemption")
    attempts = assert_same_data(chain["dir"], runs["ref"]["dir"], "preemption")
    assert [start for start, _ in attempts] == [0, stop_a, attempts[2][0]]  # each resumed where the last stopped
    assert attempts[1][0] + len(attempts[1][1]) == attempts[2][0]  # B's preemption checkpoint: nothing redone


@full_only("~10 CPU-s: the Trainer's raise under launch; the launcher's side is test_launch_reports'")
def test_rank_raising_in_forward_stops_every_rank_and_is_named(runs):
    run = runs["raise_forward"]
    assert run["rc"] == 1, run["err"][-3000:]
    assert run["elapsed_s"] < 120
    report = run["err"][run["err"].index("lockstep launch: worker rank"):]
    assert report.startswith("lockstep launch: worker rank 1 ")
    assert "RuntimeError: rank 1 fails in forward at step 4 (fault test)" in report
    assert "step 4 done" not in run["out"]  # nobody finished the step the failing rank could not


@full_only("~10 CPU-s: the Trainer's early exit under launch; the launcher's side is test_launch_reports'")
def test_worker_exiting_0_early_ends_the_others_with_the_cause(runs):
    run = runs["exit_early"]
    assert run["rc"] != 0, run["err"][-3000:]
    assert run["elapsed_s"] < 120
    assert "rank 1 exits 0 early after step 3" in run["out"]
    assert "rank 1 left training after step 3" in run["err"], run["err"][-3000:]
