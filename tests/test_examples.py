"""The examples run end to end under real launchers: `lockstep launch` and torchrun (torch.distributed.run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from levels import full_only

from lockstep.train.checkpoint import list_checkpoints, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
# --standalone: a free port, not the fixed 29500 that other jobs on this machine may hold
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LOCKSTEP_LAUNCH = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2"]


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _torch_version(source: str) -> str:
    """The same script with torch's two imports: what a user had before switching to lockstep."""
    lines = source.splitlines(keepends=True)
    swapped = [
        "from torch.nn.parallel import DistributedDataParallel as DDP\n" if line.startswith("from lockstep import DistributedDataParallel")
        else "from torch.utils.data.distributed import DistributedSampler\n" if line.startswith("from lockstep import DistributedSampler")
        else line
        for line in lines
    ]
    assert sum(a != b for a, b in zip(lines, swapped)) == 2  # exactly the two imports differ
    assert "lockstep" not in "".join(l for l in swapped if not l.lstrip().startswith(("#", '"""')) and "torch:" not in l)
    return "".join(swapped)


# torchrun runs this: the example as a user runs it, then its torch version in the same processes (one launch, not
# two; a launch costs ~7 CPU-s). Between them it checks that torch's name still holds torch's class. Two things make the
# second group safe (2026-11-26, loaded 2-core machine; 0 hangs in 18 runs with both):
# - its name: destroy_process_group resets the count that names the default group and the first group's keys are still
#   in torchrun's store, so a second group "0" can pair with stale addresses (a hang in torch's DDP constructor, 1 of 3
#   runs with the second fix alone);
# - torch's DDP, freed after its script's destroy_process_group, frees the group, whose destructor joins gloo's workers
#   holding the GIL, for good if one still waits for it to let go of a work (4 hangs in 8 runs with the name fixed
#   alone; alone in its process, the same race is torch's abort at exit, "terminate called without an active
#   exception"): the workers are settled before that, as lockstep does at exit (lockstep.ddp.lifetime).
_BOTH = """
import os, runpy, sys
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.parallel
from lockstep.ddp.lifetime import settle_gloo_workers

runpy.run_path(sys.argv[1], run_name="__main__")
assert torch.nn.parallel.DistributedDataParallel is torch.nn.parallel.distributed.DistributedDataParallel
c10d._world.group_count = 1
destroy = dist.destroy_process_group


def destroy_then_settle(*args, **kwargs):
    destroy(*args, **kwargs)
    settle_gloo_workers()


dist.destroy_process_group = destroy_then_settle
if os.environ["RANK"] == "0":
    print("--- torch's DDP ---", flush=True)
runpy.run_path(sys.argv[2], run_name="__main__")
"""


def test_torchrun_drop_in_matches_torch_ddp_bit_for_bit(tmp_path):
    script = REPO / "examples" / "torchrun_drop_in.py"
    torch_script = tmp_path / "torch_ddp_version.py"
    torch_script.write_text(_torch_version(script.read_text()))
    both = tmp_path / "lockstep_then_torch.py"
    both.write_text(_BOTH)
    ours, theirs = _run([*TORCHRUN, str(both), str(script), str(torch_script)]).split("--- torch's DDP ---\n")
    losses = [float(v) for v in re.findall(r"epoch \d+ loss (\S+)", ours)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 5  # it really trains
    digest = re.search(r"parameters sha256 ([0-9a-f]{64})", ours).group(1)
    assert digest == re.search(r"parameters sha256 ([0-9a-f]{64})", theirs).group(1)
    assert re.findall(r"epoch \d+ loss \S+", ours) == re.findall(r"epoch \d+ loss \S+", theirs)


@full_only("~55 s: two launches; the Trainer's resume across launchers is also tests/test_trainer.py's")
def test_wine_under_lockstep_launch_then_resumed_under_torchrun(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    wine = ["examples/wine.py", "--save-every", "10"]
    out = _run(LOCKSTEP_LAUNCH + wine + ["--epochs", "30", "--out", str(whole)])
    accuracy = float(re.search(r"test accuracy (\d\.\d\d)", out).group(1))
    assert accuracy >= 0.9
    # checkpoints every 10 epochs (5 steps per epoch at 2 ranks x 16 of 142 samples), the last 3 kept
    assert [s for s, _ in list_checkpoints(whole)] == [50, 100, 150]

    # the same run stopped after 20 epochs, then continued by another launcher: same parameters, exactly
    _run(LOCKSTEP_LAUNCH + wine + ["--epochs", "20", "--out", str(split)])
    assert [s for s, _ in list_checkpoints(split)] == [50, 100]
    _run(TORCHRUN + wine + ["--epochs", "30", "--out", str(split), "--resume"])
    a = load_checkpoint(whole / "ckpt-000000150.pt")["model"]
    b = load_checkpoint(split / "ckpt-000000150.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@full_only("~30 s: the example across world sizes; its restart path stays at the default (run again, test_launch's restarts)")
def test_elastic_loop_goes_on_at_another_world_size(tmp_path):
    # 20 steps of global batch 64 on 2 ranks (4 micro-batches each), then the rest on 1 rank (8 each):
    # the epoch continues at sample 20 x 64 = 1280 of its 1792, with the same global batch
    ckpt = tmp_path / "ckpt"  # not there yet, as in docs/preemptible.md's /tmp/ckpt: the script creates it
    _run(LOCKSTEP_LAUNCH + ["examples/elastic_loop.py", str(ckpt), "--max-steps", "20"])
    one = [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "1", "examples/elastic_loop.py", str(ckpt),
           "--epochs", "2"]
    # One thread, as the launcher sets for 2 ranks and not for 1: at 1 rank torch's intra-op threads spun on the
    # shared cores (this rank took 13.2 CPU-s for its 36 steps, 2.9 with one thread). The asserts are on steps.
    proc = subprocess.run(one, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert (f"resumed from step 20 (epoch 1, sample 1280 of 1792) out of {ckpt / 'checkpoint.pt'}: world size 1, "
            "8 micro-batches per step; saved by 2 ranks") in text
    # 28 steps per epoch, kept; epochs 1-based as the Trainer prints them
    assert "epoch 1 done at step 28" in text and "epoch 2 done at step 56" in text and "epoch 0" not in text
    state = torch.load(ckpt / "checkpoint.pt", weights_only=True)
    assert state["step"] == 55 and state["sampler"]["num_replicas"] == 1


def test_elastic_loop_run_again_resumes_from_its_final_checkpoint_and_has_nothing_to_train(tmp_path):
    # The repro: 5 epochs of 28 steps end on a checkpoint step (every 5th: 140), so the second run loads a
    # checkpoint whose epoch is all consumed. It crashed in rank 0's epoch line (UnboundLocalError: 'loss', nothing
    # was trained) and the launcher spent every restart on it; now it says where it resumed and that it is done.
    ckpt = tmp_path / "ckpt"
    command = [*LOCKSTEP_LAUNCH, "--max-restarts", "3", "examples/elastic_loop.py", str(ckpt), "--epochs", "5"]
    assert "epoch 5 done at step 140" in _run(command)
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[rank0]: ")]
    assert lines == [
        f"[rank0]: resumed from step 140 (epoch 5 done) out of {ckpt / 'checkpoint.pt'}: world size 2, 4 micro-batches "
        "per step; saved by 2 ranks",
        "[rank0]: nothing to train: the checkpoint finished epoch 5 of --epochs 5; raise it to go on"], proc.stdout
    assert "Traceback" not in proc.stderr and "restarting" not in proc.stderr, proc.stderr
    assert torch.load(ckpt / "checkpoint.pt", weights_only=True)["step"] == 140  # nothing trained, nothing written


def test_elastic_loop_names_a_directory_it_cannot_create(tmp_path):
    # refused before the process group starts, so the script alone (no launcher) shows the line a rank prints
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, "examples/elastic_loop.py", str(blocker)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"elastic_loop.py: cannot create the checkpoint directory {blocker}: File exists"], proc.stderr
