"""``lockstep launch --nnodes 1:2``: lose a node, keep training at the smaller size; the node comes back, grow.

Two nodes x 2 ranks in network namespaces (tests/netns.py, root only). The Trainer script
(launch_scripts/elastic_train.py) checkpoints every step; global rank 2 (node 1) pauses after
step K so the test can kill -9 every process of node 1 at an exact step. Then:
  * node 0 re-forms alone at world size 2 within RECOVER_BOUND_S and resumes from step K;
  * (grow) node 1's agent is started again: the job grows back to 4 at the next re-rendezvous;
  * the job finishes; each epoch's samples are used exactly once; the final checkpoint loads in plain torch;
  * the run equals, bit for bit, one stopped cleanly at step K on 4 ranks and resumed on 2
    (``test_kill_equals_a_clean_stop_and_resume``; without the grow-back).
Each scenario costs 1-3 minutes on a loaded 2-core machine: behind LOCKSTEP_MULTINODE_FULL=1.
The bad --nnodes values are checked without processes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import netns
import pytest
import torch
from test_inplace_loopback import each_sample_once  # launch_scripts/inplace_loop.py: each sample once per epoch
from test_launch_network import _family_tree  # pid and all its descendants, from /proc
from test_multinode import Launch, clean_env, run_forked

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launch_scripts", "elastic_train.py")
N, GLOBAL_BATCH, STEPS = 96, 16, 12  # as in elastic_train.py: 6 steps per epoch, 2 epochs
# Recovery after a node is killed: its TCP connections close, so the survivors' gloo calls fail within
# seconds; the agent stops its workers (a worker blocked in a collective only at --shutdown-timeout, 15 s),
# the next round waits for the 5 s last call (launch/elastic.py), and the new workers import torch, load
# the checkpoint and step (~10-25 s here). Measured 35-42 s on the loaded 2-core machine
# (docs/preemptible.md). The bound asserted is generous: never a hang, never gloo's 30 min.
RECOVER_BOUND_S = 90
FULL = os.environ.get("LOCKSTEP_MULTINODE_FULL") == "1"
needs_netns = pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason()))
heavy = pytest.mark.skipif(not FULL, reason="two-node elastic runs take minutes: set LOCKSTEP_MULTINODE_FULL=1")
K = random.Random(os.environ.get("LOCKSTEP_KILL_SEED", "2")).randint(2, 6)


def _argv(node_rank: int, port: int, directory: str, *extra: str, nnodes: str = "1:2") -> list[str]:
    return [sys.executable, "-m", "lockstep", "launch", "--nnodes", nnodes, "--nproc-per-node", "2",
            "--node-rank", str(node_rank), "--master-addr", netns.ADDRS[0], "--master-port", str(port),
            "--max-restarts", "3", "--recovery", "restart", SCRIPT, directory, *extra]


def _kill_node(launch: Launch) -> float:
    for pid in _family_tree([launch.proc.pid]):  # the agent and its workers (which run in sessions of their own)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launch.proc.wait(timeout=10)
    return time.time()


def _kill_the_rest(launches: list[Launch]) -> None:
    """Every node of ``launches`` still running, killed as ``_kill_node`` does (a test's ``finally``)."""
    for launch in launches:
        if launch.proc.poll() is None:
            _kill_node(launch)


def _wait_file(path: str, timeout_s: float, launches) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout_s} s:\n" + "\n".join(l.text()[-3000:] for l in launches))
        time.sleep(0.2)


def _progress(directory: str) -> list[tuple[float, int, int]]:
    rows = []
    for name in os.listdir(directory):
        if name.startswith("progress-"):
            with open(os.path.join(directory, name)) as f:
                rows += [(float(t), int(s), int(w)) for t, s, w in (line.split() for line in f)]
    return sorted(rows)


def _first_step_at(directory: str, world_size: int, after: float, timeout_s: float, launch: Launch) -> float:
    """When the first step at ``world_size`` finished (after ``after``), waiting for it up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [t for t, _, w in _progress(directory) if w == world_size and t > after]
        if done:
            return done[0]
        time.sleep(0.2)
    raise AssertionError(f"no step at world size {world_size} within {timeout_s} s:\n" + launch.text()[-3000:])


def _check_samples(directory: str) -> None:
    """Each step's global batch, whichever world size ran it (and however often, after a restart), is one
    set of GLOBAL_BATCH ids; the steps of an epoch together hold every sample exactly once."""
    per_step: dict[int, set[int]] = {}
    epoch_of: dict[int, int] = {}
    for name in os.listdir(directory):
        if name.startswith("samples-"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    rec = json.loads(line)
                    if "ids" in rec:
                        per_step.setdefault(rec["step"], set()).update(rec["ids"])
                        epoch_of[rec["step"]] = rec["epoch"]
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for step, ids in per_step.items():
        assert len(ids) == GLOBAL_BATCH, f"step {step} saw {len(ids)} distinct samples across its runs"
    for epoch in {e for e in epoch_of.values()}:
        ids = [i for s in sorted(per_step) if epoch_of[s] == epoch for i in per_step[s]]
        assert sorted(ids) == list(range(N)), f"epoch {epoch}: a sample twice or none"


def _final(directory: str) -> dict:
    return torch.load(os.path.join(directory, f"ckpt-{STEPS:09d}.pt"), weights_only=True)  # plain torch


def _node_loss(directory: str, grow: bool) -> dict:
    """Both nodes start; node 1 is killed after step K; with ``grow`` its agent starts again."""
    port = 29600 + random.randrange(300)
    measured: dict = {}
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_argv(0, port, directory, "--pause-at", str(K), *(["--hold-at-world", "2"] if grow else []))), clean_env())
        node_b = Launch(b.command(_argv(1, port, directory, "--pause-at", str(K))), clean_env())
        launches = [node_a, node_b]
        try:
            _wait_file(os.path.join(directory, "paused"), 240, launches)
            killed_at = _kill_node(node_b)
            node_a.wait_for(rf"node 1 \(10\.201\.0\.2\) left: world size 4 -> 2; resumed from step {K}$", RECOVER_BOUND_S)
            # from the kill to the first step finished at world size 2
            measured["recover_s"] = _first_step_at(directory, 2, killed_at, RECOVER_BOUND_S, node_a) - killed_at
            if grow:
                os.remove(os.path.join(directory, "paused"))
                restarted_at = time.time()
                node_b = Launch(b.command(_argv(1, port, directory)), clean_env())
                launches.append(node_b)
                node_a.wait_for(r"node 1 \(10\.201\.0\.2\) joined: world size 2 -> 4; resumed from step \d+", 180)
                # from starting node 1's agent to the first step finished at world size 4
                measured["grow_s"] = _first_step_at(directory, 4, restarted_at, 180, node_a) - restarted_at
                assert node_b.finish(240) == 0, node_b.text()[-4000:]
            assert node_a.finish(240) == 0, node_a.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    measured["text"] = node_a.text()
    return measured


@needs_netns
@heavy
def test_lose_a_node_continue_alone_then_grow_back(tmp_path):
    print(f"kill step K={K} (LOCKSTEP_KILL_SEED reproduces it)")
    measured = _node_loss(str(tmp_path), grow=True)
    print(f"recovery after the node loss: {measured['recover_s']:.1f} s; grow back: {measured['grow_s']:.1f} s")
    print("\n".join(line for line in measured["text"].splitlines() if line.startswith("lockstep launch: node 1")))
    assert measured["recover_s"] < RECOVER_BOUND_S
    _check_samples(str(tmp_path))
    final = _final(str(tmp_path))
    assert final["step"] == STEPS and final["world_size"] == 4 and final["global_batch"] == GLOBAL_BATCH


@needs_netns
@heavy
def test_kill_equals_a_clean_stop_and_resume(tmp_path):
    killed, clean = str(tmp_path / "killed"), str(tmp_path / "clean")
    os.makedirs(killed)
    os.makedirs(clean)
    measured = _node_loss(killed, grow=False)
    print(f"recovery after the node loss: {measured['recover_s']:.1f} s")
    _check_samples(killed)
    # the clean run: 2 nodes x 2 ranks stopped at step K (the killed run's layout, so its sums: lockstep launch
    # knows the nodes and DDP all-reduces hierarchically; 4 ranks on one node sum in a flat ring, 2.98e-8 off),
    # then 2 ranks on one node resume
    port = 29600 + random.randrange(300)
    with netns.two_nodes() as (a, b):
        pair = [Launch(n.command(_argv(r, port, clean, "--max-steps", str(K), nnodes="2")), clean_env())
                for r, n in enumerate((a, b))]
        for launch in pair:
            assert launch.finish(240) == 0, launch.text()[-4000:]
    done = subprocess.run([sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", SCRIPT, clean],
                          env=clean_env(), cwd=HERE, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    got, want = _final(killed), _final(clean)
    assert got["world_size"] == want["world_size"] == 2
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), f"{key}: max abs diff {(got['model'][key] - tensor).abs().max()}"
    for key, state in want["optimizer"]["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][key][k], v) for k, v in state.items())
    assert got["scheduler"] == want["scheduler"]


@pytest.mark.parametrize("value,message", [
    ("3:2", "argument --nnodes: '3:2': MIN 3 is larger than MAX 2"),
    ("0:2", "argument --nnodes: '0:2': the number of nodes must be >= 1, got 0"),
    ("1:x", "argument --nnodes: expected N or MIN:MAX (integers), got '1:x'"),
])
def test_bad_nnodes_is_one_line_naming_the_value(value, message, capsys):
    from lockstep.launch.launcher import cli_main

    assert cli_main(["--nnodes", value, SCRIPT, "dir"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"lockstep launch: error: {message}"


def test_min_max_reaches_torchs_launch_config():
    from lockstep.launch.agent import _launch_config
    from lockstep.launch.launcher import parse_launch_args
    from lockstep.launch.output import RankLogsSpecs

    options, _, _ = parse_launch_args(["--nnodes", "1:3", "--nproc-per-node", "2", "--master-addr", "10.0.0.9",
                                       "--master-port", "29999", "--node-rank", "2", SCRIPT])
    assert (options.min_nodes, options.nnodes) == (1, 3)
    config = _launch_config(options, RankLogsSpecs("/tmp", log_rank=None, max_restarts=0))
    assert (config.min_nodes, config.max_nodes) == (1, 3)
    assert config.rdzv_configs["last_call_timeout"] == 5
    fixed, _, _ = parse_launch_args(["--nnodes", "2", "--master-addr", "10.0.0.9", "--master-port", "29999", SCRIPT])
    assert fixed.min_nodes is None and _launch_config(fixed, RankLogsSpecs("/tmp", log_rank=None, max_restarts=0)).min_nodes == 2


def test_membership_line_names_who_left_or_joined_and_the_sizes():
    from lockstep.launch.elastic import describe_change

    a, b, c = ({"node_rank": r, "addr": f"10.0.0.{r + 1}", "host": "h"} for r in range(3))
    assert describe_change(None, [a, b], 2) is None  # the first round: nothing to say
    assert describe_change([a, b, c], [a, c], 4) == "node 1 (10.0.0.2) left: world size 12 -> 8"
    assert describe_change([a], [a, b, c], 2) == "node 1 (10.0.0.2), node 2 (10.0.0.3) joined: world size 2 -> 6"
    assert describe_change([a, b], [a, c], 1) == "node 1 (10.0.0.2) left; node 2 (10.0.0.3) joined: world size 2 -> 2"
    assert describe_change([a, b], [a, b], 2) == "the same 2 node(s) restarted: world size 4 -> 4"


# ---------------------------------------------------------------------------------------------------------
# In-place recovery (the default with --nnodes MIN:MAX, train/inplace.py): the survivors' workers are never
# restarted. launch_scripts/inplace_train.py writes no checkpoint until the end (nothing is read back), runs
# with --max-restarts 0 (a restart would fail the job, so the in-place path is the one that ran), and logs
# "time step world_size pid" per step. Goal (issue #37): <= 5 s from the kill to the next step at the smaller
# size; asserted loosely (a loaded 2-core machine), printed exactly.
INPLACE = os.path.join(HERE, "launch_scripts", "inplace_train.py")
INPLACE_BOUND_S = 30
LEFT_LINE = (r"lockstep launch: node 1 \(10\.201\.0\.2\) left at step (\d+): world (\d+) -> (\d+) in ([\d.]+) s, "
             r"0 steps lost$")


def _inplace_argv(node_rank: int, nproc: int, port: int, directory: str, *extra: str, nnodes: str = "1:2",
                  script: str = INPLACE) -> list[str]:
    # --max-restarts 0: a failure restarts nothing (a membership change does not count, as in torchrun)
    return [sys.executable, "-m", "lockstep", "launch", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--node-rank", str(node_rank), "--master-addr", netns.ADDRS[0], "--master-port", str(port),
            "--max-restarts", "0", script, directory, *extra]


def _rows(directory: str) -> list[tuple[float, int, int, int]]:
    """(time, step, world size, pid) of every step every worker finished, in time order."""
    rows = []
    for name in os.listdir(directory):
        if name.startswith("progress-"):
            with open(os.path.join(directory, name)) as f:
                rows += [(float(t), int(s), int(w), int(p)) for t, s, w, p in (line.split() for line in f)]
    return sorted(rows)


def _wait_step(directory: str, step: int, timeout_s: float, launches) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(s >= step for _, s, _, _ in _rows(directory)):
        if time.monotonic() > deadline:
            raise AssertionError(f"no step {step} in {timeout_s} s:\n" + "\n".join(x.text()[-3000:] for x in launches))
        time.sleep(0.05)


def _wait_for_a_step(directory: str, launch: Launch, timeout_s: float = 240) -> list[tuple[float, int, int, int]]:
    """The rows (``_rows``) once ``launch``'s workers finished a step; fails the test if none did in time."""
    deadline = time.monotonic() + timeout_s
    while not _rows(directory) and time.monotonic() < deadline and launch.proc.poll() is None:
        time.sleep(0.2)
    rows = _rows(directory)
    assert rows, "node 0 never trained a step:\n" + launch.text()[-4000:]
    return rows


def _samples_once(directory: str, complete: bool) -> None:
    """No sample twice in an epoch, whichever world size dealt it; with ``complete``, every sample once. A node
    killed at a random moment may have committed a step without logging its share: then one step may lack it."""
    per_step: dict[tuple[int, int], set[int]] = {}
    for name in os.listdir(directory):
        if name.startswith("samples-"):
            with open(os.path.join(directory, name)) as f:
                for rec in map(json.loads, f):
                    if "ids" in rec:
                        per_step.setdefault((rec["epoch"], rec["step"]), set()).update(rec["ids"])
    assert sorted(s for _, s in per_step) == list(range(1, STEPS + 1))
    for epoch in {e for e, _ in per_step}:
        steps = [ids for (e, _), ids in per_step.items() if e == epoch]
        seen = [i for ids in steps for i in ids]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample in two steps"
        short = [len(ids) for ids in steps if len(ids) != GLOBAL_BATCH]
        assert not short if complete else len(short) <= 1, f"epoch {epoch}: steps of {short} samples"


def _lose_node_in_place(directory: str, nproc: int, kill_step: int | None = None, pause_at: int | None = None,
                        in_final_save: bool = False, extra: tuple[str, ...] = (), left_line: str = LEFT_LINE) -> dict:
    """Both nodes train; node 1 is killed (every process) while paused after ``pause_at`` (the others wait in the
    next step), or in the save after the last epoch (``in_final_save``: the others wait in its collectives), or as
    soon as some rank finished ``kill_step``. Node 0 must go on in place and finish. ``extra``: the script's
    arguments; ``left_line``: the launcher's line to wait for."""
    port = 29600 + random.randrange(300)
    pause = ["--pause-at", str(pause_at), "--pause-rank", str(nproc)] if pause_at is not None else []
    pause += extra
    if in_final_save:
        pause, pause_at = ["--pause-in-final-save", "--pause-rank", str(nproc)], STEPS
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, nproc, port, directory, *pause)), clean_env())
        node_b = Launch(b.command(_inplace_argv(1, nproc, port, directory, *pause)), clean_env())
        try:
            if pause_at is not None:
                _wait_file(os.path.join(directory, "paused"), 240, [node_a, node_b])
            else:
                _wait_step(directory, kill_step or 1, 240, [node_a, node_b])
            before = _rows(directory)
            killed_at = _kill_node(node_b)
            node_a.wait_for(left_line, INPLACE_BOUND_S + 30)
            after_kill = [r for r in _rows(directory) if r[0] > killed_at and r[2] == nproc]
            assert node_a.finish(240) == 0, node_a.text()[-4000:]
        finally:
            for launch in (node_a, node_b):
                if launch.proc.poll() is None:
                    _kill_node(launch)
    line = next(m for m in (re.search(left_line, x) for x in node_a.err) if m)
    rows = _rows(directory)
    return {"text": node_a.text(), "line": line.group(0), "step": int(line.group(1)),
            "worlds": (int(line.group(2)), int(line.group(3))), "reported_s": float(line.group(4)),
            "recover_s": after_kill[0][0] - killed_at if after_kill else None,
            "pids_before": {p for _, _, w, p in before if w == 2 * nproc},
            "pids_after": {p for _, _, w, p in rows if w == nproc},
            "last_step_before": max(s for _, s, _, _ in before)}


# A reference's folder after each sequence of clean stops run so far, by that sequence: a test whose reference
# begins as an earlier one's (the 2 x 2 stop at K of the mid-step kill and of the grow-back) starts from a copy.
_CLEAN_SO_FAR: dict[tuple, str] = {}  # (the script's extra arguments, *stops) -> folder


def _clean_stops(directory: str, stops: list[tuple[int, int, int | None]], extra: tuple[str, ...] = ()) -> dict:
    """The reference: (nodes, ranks per node, --max-steps) one after another in one folder, each resuming the last
    one's checkpoint; forked ranks laid out as those nodes (test_multinode.run_forked: 2 x 2 sums hierarchically
    as when launched in two namespaces with a fixed --nnodes 2), bit for bit with the launched runs."""
    done = next((n for n in range(len(stops), 0, -1) if (extra, *stops[:n]) in _CLEAN_SO_FAR), 0)
    if done:
        shutil.copytree(_CLEAN_SO_FAR[(extra, *stops[:done])], directory, dirs_exist_ok=True)
    for n in range(done, len(stops)):
        nodes, nproc, steps = stops[n]
        limit = ["--max-steps", str(steps)] if steps is not None else []
        run_forked(INPLACE, nodes, nproc, directory, *limit, *extra, log_dir=directory)
        _CLEAN_SO_FAR[(extra, *stops[: n + 1])] = shutil.copytree(directory, f"{directory}.after-{n + 1}-stops")
    return _final(directory)


def _assert_bit_for_bit(got: dict, want: dict) -> None:
    assert got["step"] == want["step"] == STEPS and got["world_size"] == want["world_size"]
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), f"{key}: max abs diff {(got['model'][key] - tensor).abs().max()}"
    for key, state in want["optimizer"]["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][key][k], v) for k, v in state.items())
    assert got["scheduler"] == want["scheduler"]


def _check_in_place(measured: dict, nproc: int) -> None:
    # A kill drawn "once step K was done" can land after the last step when the job outran it (seen at load: run 4,
    # K = 10, the kill after step 12): the survivors then re-form inside the final save and no step follows, so
    # there is no step at the new size to time and no process to count by its steps
    last = measured["last_step_before"] == STEPS
    recover = "none (killed after the last step)" if last else f"{measured['recover_s']:.2f} s"
    print(f"{measured['line']}; kill to the next step at world size {nproc}: {recover}")
    assert measured["worlds"] == (2 * nproc, nproc)
    assert measured["pids_after"] <= measured["pids_before"] and len(measured["pids_after"]) == (0 if last else nproc)
    assert "restarted" not in measured["text"] and "resumed from step" not in measured["text"]
    # no completed step lost: the survivors went on from the last step any rank finished before the kill, or
    # the one after it (a step in flight whose commit had completed somewhere)
    assert measured["step"] >= measured["last_step_before"]
    assert last or (measured["recover_s"] is not None and measured["recover_s"] < INPLACE_BOUND_S)


@needs_netns
def test_in_place_a_node_killed_mid_step_loses_no_step_and_equals_a_clean_resume(tmp_path):
    """2 x 2: node 1 killed while its first rank pauses after step K and the others wait inside step K + 1."""
    killed, clean = str(tmp_path / "killed"), str(tmp_path / "clean")
    os.makedirs(killed)
    os.makedirs(clean)
    measured = _lose_node_in_place(killed, 2, pause_at=K)
    _check_in_place(measured, 2)
    assert measured["step"] == K  # step K + 1 was in flight: discarded on every survivor, done again at 2
    _samples_once(killed, complete=True)
    _assert_bit_for_bit(_final(killed), _clean_stops(clean, [(2, 2, K), (1, 2, None)]))


@needs_netns
@heavy  # ~40 s; test_diloco_inplace.py's loopback runs are the default level's
def test_in_place_diloco_a_node_lost_between_syncs_costs_the_steps_since_the_last(tmp_path):
    """DiLoCo (a sync every 4 steps), 2 x 1 under lockstep launch: node 1 killed while paused after step 7 and
    node 0 waits for it in step 8's outer all-reduce. Node 0's launcher says the node left at step 7 and that 3
    steps were lost (node 0 went back to the sync of step 4), it finishes in its process, and the final model equals
    clean stops bit for bit (2 x 1 to step 4, 1 x 1 to the end)."""
    killed, clean = str(tmp_path / "killed"), str(tmp_path / "clean")
    os.makedirs(killed)
    os.makedirs(clean)
    left = LEFT_LINE.replace("0 steps lost", "3 steps lost")
    measured = _lose_node_in_place(killed, 1, pause_at=7, extra=("--diloco", "4"), left_line=left)
    assert measured["step"] == 7 and measured["worlds"] == (2, 1), measured["line"]
    assert measured["pids_after"] <= measured["pids_before"] and "restarted" not in measured["text"]
    rows = _rows(killed)
    assert [s for _, s, w, _ in rows if w == 1][:4] == [5, 6, 7, 8]  # from the sync of step 4, in the same process
    want = _clean_stops(clean, [(2, 1, 4), (1, 1, None)], extra=("--diloco", "4"))
    got = _final(killed)
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), key


@needs_netns
@heavy  # ~40 s; the default level keeps a node lost mid-step and node 0 lost and back
def test_in_place_a_node_lost_in_the_last_save_is_recovered_and_the_survivors_save(tmp_path):
    """2 x 1: node 1 killed inside the save after the last epoch (the others wait in its gather). That save ran
    outside the Trainer's recovery loop, so the survivor failed (PeerLeft: a random kill landed there, 2026-11-26);
    now it re-forms, saves the last step at its own size, and the model equals a clean run's to the end."""
    killed, clean = str(tmp_path / "killed"), str(tmp_path / "clean")
    os.makedirs(killed)
    os.makedirs(clean)
    measured = _lose_node_in_place(killed, 1, in_final_save=True)
    assert measured["worlds"] == (2, 1) and measured["step"] == STEPS, measured["line"]
    assert "restarted" not in measured["text"] and "resumed from step" not in measured["text"]
    got, want = _final(killed), _clean_stops(clean, [(2, 1, None)])
    assert (got["step"], got["world_size"], want["world_size"]) == (STEPS, 1, 2)
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), key
    for key, state in want["optimizer"]["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][key][k], v) for k, v in state.items())


@needs_netns
@heavy
@pytest.mark.parametrize("run", range(10))
def test_in_place_kill_at_random_steps(tmp_path, run):
    """10 random kill points (LOCKSTEP_KILL_SEED), 2 x 2 and 2 x 1 in turn, each against its clean resume."""
    nproc = 2 if run % 2 == 0 else 1
    step = random.Random(f"{os.environ.get('LOCKSTEP_KILL_SEED', '2')}-{run}").randint(1, STEPS - 2)
    killed, clean = str(tmp_path / "killed"), str(tmp_path / "clean")
    os.makedirs(killed)
    os.makedirs(clean)
    measured = _lose_node_in_place(killed, nproc, kill_step=step)
    print(f"run {run}: 2 x {nproc}, killed once step {step} was done")
    _check_in_place(measured, nproc)
    _samples_once(killed, complete=False)
    _assert_bit_for_bit(_final(killed), _clean_stops(clean, [(2, nproc, measured["step"]), (1, nproc, None)]))


def test_in_place_line_names_the_node_the_step_the_sizes_and_the_time():
    from lockstep.launch.elastic import describe_in_place

    a, b, c = ({"node_rank": r, "addr": f"10.201.0.{r + 1}", "host": "h"} for r in range(3))
    record = {"left": [2, 3], "old_world": 4, "world": 2, "step": 812, "seconds": 1.84, "lost": 0}
    line, left = describe_in_place(record, [a, b], 2)
    assert line == "node 1 (10.201.0.2) left at step 812: world 4 -> 2 in 1.8 s, 0 steps lost" and left == [b]
    line, left = describe_in_place({**record, "left": [1], "old_world": 3}, [a, b, c], 1)
    assert line.startswith("node 1 (10.201.0.2) left at step 812: world 3 -> 2") and left == [b]
    line, _ = describe_in_place({**record, "left": [3], "world": 3}, [a, b], 2)  # one worker of a node
    assert line.startswith("node 1 (10.201.0.2) (ranks [3]) left at step 812: world 4 -> 3")
    # a grow: the newcomers' ids name their nodes through the record's "where"; seconds from their launch
    grow = {"left": [], "joined": [4, 5], "old_world": 2, "world": 4, "step": 815, "seconds": 6.24, "paused": 0.41,
            "lost": 0, "where": {"4": b, "5": b}}
    line, joined = describe_in_place(grow, [a], 2)
    assert line == ("node 1 (10.201.0.2) joined at step 815: world 2 -> 4 in 6.2 s from its launch, the others "
                    "paused 0.4 s")
    assert joined == [b]
    line, left = describe_in_place({**record, "left": [4, 5], "where": grow["where"]}, [a], 2)  # a newcomer leaves
    assert line.startswith("node 1 (10.201.0.2) left at step 812") and left == [b]


@pytest.mark.parametrize("argv,expected", [
    (["--nnodes", "1:2", "--nproc-per-node", "2"], ("1", "2")),
    (["--nnodes", "1:2", "--recovery", "restart"], (None, None)),
    (["--nnodes", "2"], (None, None)),  # a fixed size has no smaller size to go on at
])
def test_in_place_is_on_for_min_max_unless_restart_is_asked_for(argv, expected):
    from lockstep import keys  # the one home of the names the launcher and the workers share
    from lockstep.launch.agent import _agent_environment
    from lockstep.launch.launcher import parse_launch_args

    options, _, _ = parse_launch_args([*argv, "--master-addr", "10.0.0.9", "--master-port", "29999", SCRIPT])
    with _agent_environment(options):
        assert (os.environ.get(keys.INPLACE_ENV), os.environ.get(keys.INPLACE_MIN_WORLD_ENV)) == expected
    assert os.environ.get(keys.INPLACE_ENV) is None


def test_bad_recovery_is_one_line_naming_the_flag(capsys):
    from lockstep.launch.launcher import cli_main

    assert cli_main(["--nnodes", "1:2", "--recovery", "later", SCRIPT, "dir"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1].replace("'", "")  # Pythons differ in quoting choices
    assert line == "lockstep launch: error: argument --recovery: invalid choice: later (choose from in-place, restart)"


def _lose_node_1_and_start_it_again(directory: str, nproc: int, node_0_extra: list[str], node_1_extra: list[str],
                                    back_line: str, back_timeout_s: float,
                                    script: str = INPLACE) -> tuple[Launch, Launch, set[int], float]:
    """2 x ``nproc`` in place: node 1 killed once its paused rank wrote ``paused``, node 0 goes on alone (its left
    line), node 1's launcher started again; both run to the end once node 0 prints ``back_line``. Returns node 0's
    launch, node 1's second launch, the survivors' PIDs and when node 1 started again (time.time())."""
    port = 29600 + random.randrange(300)
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, nproc, port, directory, *node_0_extra, script=script)), clean_env())
        node_b = Launch(b.command(_inplace_argv(1, nproc, port, directory, *node_1_extra, script=script)), clean_env())
        launches = [node_a, node_b]
        try:
            _wait_file(os.path.join(directory, "paused"), 240, launches)
            _kill_node(node_b)
            node_a.wait_for(LEFT_LINE, INPLACE_BOUND_S + 30)
            os.remove(os.path.join(directory, "paused"))
            survivors = {p for _, _, w, p in _rows(directory) if w == nproc}
            started = time.time()
            node_b = Launch(b.command(_inplace_argv(1, nproc, port, directory, script=script)), clean_env())
            launches.append(node_b)
            node_a.wait_for(back_line, back_timeout_s)
            assert node_b.finish(240) == 0, node_b.text()[-4000:]
            assert node_a.finish(240) == 0, node_a.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    return node_a, node_b, survivors, started


@needs_netns
@heavy  # about 70 s: the grown run, then two clean stops and resumes
def test_in_place_a_new_node_joins_a_job_that_started_at_world_size_1(tmp_path):
    """``--nnodes 1:2 --nproc-per-node 1``, node 0 alone: a world of one rank. A second machine started later joins
    in place at a step boundary (node 0's process kept), as into a larger job; before, in-place recovery was off at
    world size 1, so the new node made node 0's agent restart its worker from the last checkpoint (none here: from
    the beginning). Bit for bit with a run stopped cleanly at the join step on 1 rank and resumed on 2. Node 0 holds
    its first step until node 1's ranks wait to join (its 0.3 s steps once let it finish first on a loaded machine)."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    port = 29600 + random.randrange(300)
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, 1, port, grown, "--hold-at-world", "1")), clean_env())
        launches = [node_a]
        try:
            first = _wait_for_a_step(grown, node_a)
            node_b = Launch(b.command(_inplace_argv(1, 1, port, grown)), clean_env())
            launches.append(node_b)
            assert node_b.finish(300) == 0, node_b.text()[-4000:]
            assert node_a.finish(300) == 0, node_a.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    line = next((m for m in (re.search(JOIN_LINE, x) for x in node_a.err) if m), None)
    assert line is not None and (int(line.group(2)), int(line.group(3))) == (1, 2), node_a.text()[-4000:]
    assert "joins the running job in place" in node_b.text() and "restarted" not in node_a.text()
    rows = _rows(grown)
    assert first[0][3] in {p for _, _, w, p in rows if w == 2}, "node 0's worker was restarted"
    _samples_once(grown, complete=True)
    want = _clean_stops(clean, [(1, 1, int(line.group(1))), (1, 2, None)])
    _assert_bit_for_bit(_final(grown), want)


@needs_netns
@heavy  # about 60 s: node 0's steps sleep 10 s each, so that node 1's ranks wait at the boundary long enough
def test_in_place_a_newcomers_ctrl_c_while_it_waits_to_be_admitted_is_one_line_and_the_job_goes_on(tmp_path):
    """Node 0 alone at world size 2 (``--nnodes 1:2``); node 1's launcher joins in place, its ranks announce
    themselves and wait for the next step boundary (node 0's rank 0 saw them: ``join-ready``); then Ctrl-C (SIGINT
    to node 1's launcher), as a user who started the wrong machine would: node 1 says one line and exits 130 within
    10 s, with no traceback; node 0 admits nobody (the newcomers fell silent before the boundary), prints no joined
    or left line, and finishes its steps at world size 2 with exit 0."""
    directory, port = str(tmp_path), 29600 + random.randrange(300)
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, 2, port, directory, "--step-sleep", "10", "--max-steps", "4",
                                                "--note-joins")), clean_env())
        launches = [node_a]
        try:
            _wait_for_a_step(directory, node_a)
            node_b = Launch(b.command(_inplace_argv(1, 2, port, directory)), clean_env())
            launches.append(node_b)
            _wait_file(os.path.join(directory, "join-ready"), 120, launches)
            stopped = time.monotonic()
            node_b.proc.send_signal(signal.SIGINT)
            assert node_b.finish(30) == 130, node_b.text()[-4000:]
            took_s = time.monotonic() - stopped
            assert node_a.finish(240) == 0, node_a.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    said = [line for line in node_b.err if line.startswith("lockstep launch:")]
    assert said[-1] == "lockstep launch: stopped by Ctrl-C (SIGINT); 2 workers stopped", node_b.text()[-4000:]
    assert "Traceback" not in node_b.text() and took_s < 10, (took_s, node_b.text()[-4000:])
    assert not any(re.search(r"joined|left at step", line) for line in node_a.err), node_a.text()[-4000:]
    rows = _rows(directory)
    assert {w for _, _, w, _ in rows} == {2} and max(s for _, s, _, _ in rows) == 4, rows


@needs_netns
@heavy
def test_in_place_shrink_then_grow_back_by_restart(tmp_path):
    """After an in-place shrink, node 1 starts again and the job admits no newcomer in place (``--refuse-joins``):
    growing back takes the restart path (the survivors checkpoint on the agent's SIGTERM and
    every worker resumes at 4); the job finishes, each epoch's samples once."""
    directory = str(tmp_path)
    _, _, _, started = _lose_node_1_and_start_it_again(
        directory, 2, ["--pause-at", str(K), "--hold-at-world", "2", "--refuse-joins"], ["--pause-at", str(K)],
        r"node 1 \(10\.201\.0\.2\) joined: world size 2 -> 4; resumed from step \d+", 180)
    grow_s = next(t for t, _, w, _ in _rows(directory) if w == 4 and t > started) - started
    print(f"grow back (restart path): {grow_s:.1f} s from node 1's agent start to a step at world size 4")
    _samples_once(directory, complete=True)
    assert _final(directory)["world_size"] == 4


JOIN_LINE = (r"lockstep launch: node 1 \(10\.201\.0\.2\) joined at step (\d+): world (\d+) -> (\d+) in ([\d.]+) s from "
             r"its launch, the others paused ([\d.]+) s$")
JOIN_GOAL_S = 10  # issue #37: the returning node trains <= 10 s after its agent starts (printed, asserted loosely)


def _shrink_then_grow_in_place(directory: str, nproc: int = 2) -> dict:
    """2 x ``nproc``: node 1 killed while its first rank pauses after step K (node 0 goes on alone in place and
    holds its first step there until a node waits to join); node 1's launcher starts again and joins in place."""
    pause = ["--pause-at", str(K), "--pause-rank", str(nproc)]
    node_a, node_b, survivors, started = _lose_node_1_and_start_it_again(
        directory, nproc, [*pause, "--hold-at-world", str(nproc)], pause, JOIN_LINE, 120)
    rows = _rows(directory)
    line = next(m for m in (re.search(JOIN_LINE, x) for x in node_a.err) if m)
    return {"text": node_a.text(), "joiner": node_b.text(), "line": line.group(0), "step": int(line.group(1)),
            "worlds": (int(line.group(2)), int(line.group(3))), "reported_s": float(line.group(4)),
            "paused_s": float(line.group(5)), "survivors": survivors,
            "grow_s": next(t for t, _, w, _ in rows if w == 2 * nproc and t > started) - started,
            "pids_at_4": {p for t, _, w, p in rows if w == 2 * nproc and t > started},
            "shrink_step": int(next(m for m in (re.search(LEFT_LINE, x) for x in node_a.err) if m).group(1))}


@needs_netns
@heavy  # ~60 s; the default level keeps node 0 killed and back in place (a shrink, then a grow)
def test_in_place_shrink_then_grow_back_in_place(tmp_path):
    """After an in-place shrink, node 1's launcher starts again and its ranks join the running group at a step
    boundary: the survivors keep their processes (same PIDs), the newcomers take parameters, optimizer, scheduler,
    step and data position from rank 0 over the group (no checkpoint: the script writes one only at the end), and
    the run equals, bit for bit, one stopped cleanly at the shrink step on 4 ranks, resumed on 2, stopped at the
    grow step and resumed on 4 (one node: the grown group sums flat, as one node does)."""
    _grow_back_in_place(tmp_path, 2)


def _grow_back_in_place(tmp_path, nproc: int) -> None:
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    measured = _shrink_then_grow_in_place(grown, nproc)
    print(f"{measured['line']}; node 1's launch to its first step at world size {2 * nproc}: "
          f"{measured['grow_s']:.2f} s (goal {JOIN_GOAL_S} s)")
    assert measured["shrink_step"] == K and measured["step"] > K and measured["worlds"] == (nproc, 2 * nproc)
    assert len(measured["survivors"]) == nproc and measured["survivors"] <= measured["pids_at_4"]  # not restarted
    assert len(measured["pids_at_4"]) == 2 * nproc
    assert "restarted" not in measured["text"] and "resumed from step" not in measured["text"]
    assert "joins the running job in place" in measured["joiner"]
    assert measured["grow_s"] < 60  # the goal is 10 s (printed above); a loaded 2-core machine gets slack
    _samples_once(grown, complete=True)
    want = _clean_stops(clean, [(2, nproc, K), (1, nproc, measured["step"]), (1, 2 * nproc, None)])
    _assert_bit_for_bit(_final(grown), want)


LOOP = os.path.join(HERE, "launch_scripts", "inplace_loop.py")  # a script's own loop with lockstep.InPlaceRecovery


@needs_netns
@heavy  # about 60 s on the loaded 2-core machine (the grown run, then three clean stops and resumes)
def test_in_place_a_plain_loop_grows_back_in_place(tmp_path):
    """The same with a script's own loop (``lockstep.InPlaceRecovery``, launch_scripts/inplace_loop.py), 2 x 2: node 1
    killed while its first rank pauses after step K, node 0 goes on alone in place, node 1's launcher started again
    joins in place at a step boundary (the survivors' PIDs kept); the newcomers take parameters, optimizer state,
    step and data position from rank 0 over the group; each epoch's samples once; the final parameters equal, bit for
    bit, a run stopped cleanly at K on 4 ranks, resumed on 2, stopped at the grow step and resumed on 4 (the script
    sums flat: one node x 4 ranks sums as two x 2)."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    pause = ["--pause-at", str(K), "--pause-rank", "2"]
    node_a, node_b, survivors, started = _lose_node_1_and_start_it_again(
        grown, 2, [*pause, "--hold-at-world", "2"], pause, JOIN_LINE, 120, script=LOOP)
    line = next(m for m in (re.search(JOIN_LINE, x) for x in node_a.err) if m)
    rows = _rows(grown)
    grow_s = next(t for t, _, w, _ in rows if w == 4 and t > started) - started
    print(f"{line.group(0)}; node 1's launch to its first step at world size 4: {grow_s:.2f} s (goal {JOIN_GOAL_S} s)")
    assert "joins the running job in place" in node_b.text()
    assert "restarted" not in node_a.text() and "resumed from step" not in node_a.text()
    assert len(survivors) == 2 and survivors <= {p for t, _, w, p in rows if w == 4 and t > started}  # same PIDs
    assert grow_s < 60  # the goal is 10 s (printed above); a loaded 2-core machine gets slack
    grow_step = max(s for _, s, w, _ in rows if w == 2)
    assert (int(line.group(2)), int(line.group(3))) == (2, 4) and int(line.group(1)) == grow_step
    each_sample_once(grown)
    for nproc, limit in ((4, ["--max-steps", str(K)]), (2, ["--max-steps", str(grow_step)]), (4, [])):
        done = subprocess.run([sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", str(nproc), LOOP, clean,
                               *limit], env=clean_env(), cwd=HERE, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    got, want = (torch.load(os.path.join(d, "final.pt"), weights_only=True) for d in (grown, clean))
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), f"{key}: max abs diff {(got[key] - tensor).abs().max()}"


@needs_netns
@heavy
def test_in_place_twice_lost_twice_back(tmp_path):
    """2 x 2: node 1 lost after step K and back in place, then its new ranks lost (a newcomer's loss, named by the
    node it joined from) and back again; same PIDs on node 0 throughout, each sample once, bit for bit with the
    five clean stops and resumes."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    port, paused = 29600 + random.randrange(300), os.path.join(grown, "paused")
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, 2, port, grown, "--pause-at", str(K), "--hold-at-world", "2")),
                        clean_env())
        launches = [node_a, Launch(b.command(_inplace_argv(1, 2, port, grown, "--pause-at", str(K))), clean_env())]
        steps, times = [], []
        try:
            for cycle in range(2):
                _wait_file(paused, 240, launches)
                _kill_node(launches[-1])
                _wait_lines(node_a, LEFT_LINE, cycle + 1, INPLACE_BOUND_S + 30)
                os.remove(paused)
                started = time.time()
                again = ["--pause-at", str(K + 3), "--pause-rank", "2"] if cycle == 0 else []  # 1 step at 4, then lost
                launches.append(Launch(b.command(_inplace_argv(1, 2, port, grown, *again)), clean_env()))
                joined = _wait_lines(node_a, JOIN_LINE, cycle + 1, 120)[-1]
                steps += [int(_wait_lines(node_a, LEFT_LINE, cycle + 1, 1)[-1].group(1)), int(joined.group(1))]
                times.append(next(t for t, _, w, _ in _rows(grown) if w == 4 and t > started) - started)
            assert launches[-1].finish(240) == 0, launches[-1].text()[-4000:]
            assert node_a.finish(240) == 0, node_a.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    print("\n".join(line for line in node_a.err if "left at" in line or "joined at" in line))
    print(f"steps (lost, back, lost, back): {steps}; node 1's launch to a step at 4: {[round(t, 2) for t in times]} s")
    assert steps == [K, K + 2, K + 3, K + 5]  # each grow right after the held step: the first at 2 after the shrink
    pids_a = {p for _, _, w, p in _rows(grown) if w == 2}
    assert len(pids_a) == 2 and all(p in {q for _, s, w, q in _rows(grown) if s == STEPS} for p in pids_a)
    _samples_once(grown, complete=True)
    stops = [(2, 2, steps[0]), (1, 2, steps[1]), (1, 4, steps[2]), (1, 2, steps[3]), (1, 4, None)]
    _assert_bit_for_bit(_final(grown), _clean_stops(clean, stops))


def _wait_lines(launch: Launch, pattern: str, count: int, timeout_s: float) -> list[re.Match]:
    """The first ``count`` lines of ``launch``'s stderr that match, waiting up to ``timeout_s`` for them."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [m for m in (re.search(pattern, line) for line in list(launch.err)) if m]
        if len(found) >= count:
            return found[:count]
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {count} lines matching {pattern!r} in {timeout_s} s:\n"
                                 + launch.text()[-4000:])
        time.sleep(0.1)


@needs_netns
@heavy
@pytest.mark.parametrize("run", range(4))
def test_in_place_grow_back_repeats(tmp_path, run):
    """The same at 2 x 1 and 2 x 2 in turn, twice each: the join time printed each run (issue #37's table)."""
    _grow_back_in_place(tmp_path, 1 if run % 2 else 2)


# ---------------------------------------------------------------------------------------------------------
# No node is special (issue #37 item 3): node 0 serves the rendezvous store and the workers' store; when every
# process of node 0 dies, the survivors' workers move their store to the lowest surviving node's standby store
# (each agent serves one), their agents follow, and the job goes on in place; node 0's launcher started again
# finds the running round (written into its new store by the survivors) and joins in place.
NODE_0_LEFT = (r"lockstep launch: node 0 \(10\.201\.0\.1\) left at step (\d+): world (\d+) -> (\d+) in ([\d.]+) s, "
               r"0 steps lost$")
NODE_0_JOINED = (r"lockstep launch: node 0 \(10\.201\.0\.1\) joined at step (\d+): world (\d+) -> (\d+) in ([\d.]+) s "
                 r"from its launch, the others paused ([\d.]+) s$")


def _lose_node_0_and_start_it_again(directory: str, nproc: int, cycles: int, first: int = K) -> dict:
    """2 x ``nproc`` in place: node 0 killed (every process) while its first rank pauses after step first + 3 x cycle
    and node 1's ranks wait inside the next step; node 1 goes on alone (same PIDs); node 0's launcher is started
    again with the same command and joins in place; ``cycles`` times (the first kill moves the workers' store to
    node 1, the later ones lose a node that had joined). Both launchers exit 0 at the end."""
    port, paused = 29600 + random.randrange(300), os.path.join(directory, "paused")
    measured: dict = {"recover_s": [], "back_s": [], "left": [], "joined": []}
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, nproc, port, directory, "--pause-at", str(first), "--pause-rank",
                                                "0")), clean_env())
        node_b = Launch(b.command(_inplace_argv(1, nproc, port, directory, "--hold-at-world", str(nproc))),
                        clean_env())
        launches = [node_a, node_b]
        try:
            for cycle in range(cycles):
                _wait_file(paused, 240, launches)
                measured.setdefault("pids_before", {p for _, _, w, p in _rows(directory) if w == 2 * nproc})
                killed_at = _kill_node(launches[-1] if cycle else node_a)
                left = _wait_lines(node_b, NODE_0_LEFT, cycle + 1, INPLACE_BOUND_S + 30)[-1]
                measured["left"].append(int(left.group(1)))
                measured["recover_s"].append(
                    next(t for t, _, w, _ in _rows(directory) if w == nproc and t > killed_at) - killed_at)
                os.remove(paused)
                started = time.time()
                again = ["--pause-at", str(first + 3 * (cycle + 1)), "--pause-rank", str(nproc)] * (cycle + 1 < cycles)
                launches.append(Launch(a.command(_inplace_argv(0, nproc, port, directory, *again)), clean_env()))
                measured["joined"].append(int(_wait_lines(node_b, NODE_0_JOINED, cycle + 1, 120)[-1].group(1)))
                measured["back_s"].append(
                    next(t for t, _, w, _ in _rows(directory) if w == 2 * nproc and t > started) - started)
            assert launches[-1].finish(240) == 0, launches[-1].text()[-4000:]
            assert node_b.finish(240) == 0, node_b.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    measured["text"], measured["returned"] = node_b.text(), launches[2].text()
    measured["pids_b"] = {p for _, _, w, p in _rows(directory) if w == nproc}
    return measured


@needs_netns
def test_in_place_node_0_killed_the_others_go_on_and_it_comes_back_in_place(tmp_path):
    """2 x 1: every process of node 0 (which served both stores) killed while its rank pauses after step K and node
    1's rank waits inside step K + 1: node 1 goes on alone from step K with the same PID, 0 steps lost; node 0's
    launcher, started again with the same command, joins in place; both exit 0; each epoch's samples once; the
    final parameters equal those of a run stopped cleanly at K on 2 ranks, resumed on 1, stopped at the grow step
    and resumed on 2."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    measured = _lose_node_0_and_start_it_again(grown, 1, cycles=1)
    print(f"node 0 killed: step {measured['left']}, kill to a step at world size 1 {measured['recover_s']} s; "
          f"back at step {measured['joined']}, its launch to a step at world size 2 {measured['back_s']} s")
    assert measured["left"] == [K] and measured["joined"][0] > K
    assert len(measured["pids_b"]) == 1 and measured["pids_b"] <= measured["pids_before"]  # node 1 not restarted
    assert "node 0 (10.201.0.1) stopped answering; the workers moved their store to node 1" in measured["text"]
    assert "restarted" not in measured["text"] and "resumed from step" not in measured["text"]
    assert "node 0 joins the running job in place" in measured["returned"]
    assert measured["recover_s"][0] < INPLACE_BOUND_S and measured["back_s"][0] < 60
    _samples_once(grown, complete=True)
    _assert_bit_for_bit(_final(grown), _clean_stops(clean, [(2, 1, K), (1, 1, measured["joined"][0]), (1, 2, None)]))


def test_split_brain_rule_a_side_without_the_store_goes_on_only_with_a_majority_or_the_half_without_node_0():
    from lockstep.train.inplace import may_go_on_without_store

    two = {0: 0, 1: 0, 2: 1, 3: 1}  # launch rank -> node rank, 2 x 2
    assert may_go_on_without_store([0, 1, 2, 3], [2, 3], two, 0)  # two nodes: node 0 gone (or cut off)
    three = {r: r // 2 for r in range(6)}
    assert may_go_on_without_store(list(range(6)), [2, 3, 4, 5], three, 0)  # 2 of 3 nodes
    assert not may_go_on_without_store(list(range(6)), [4, 5], three, 0)  # 1 of 3: the others may train on
    four = {r: r // 2 for r in range(8)}
    assert not may_go_on_without_store(list(range(8)), [4, 5, 6, 7], four, 0)  # half, but nodes 0 and 1 are gone
    assert may_go_on_without_store(list(range(8)), [2, 3, 4, 5, 6, 7], four, 0)


@needs_netns
@heavy
def test_in_place_node_0_killed_three_times_back_each_time(tmp_path):
    """2 x 2: node 0 killed after step 2 (the store moves to node 1), back in place; then the ranks it came back
    with killed twice more (after steps 5 and 8), back each time; node 1's PIDs kept throughout, each sample
    once, bit for bit with the seven clean stops and resumes."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    measured = _lose_node_0_and_start_it_again(grown, 2, cycles=3, first=2)
    print("\n".join(line for line in measured["text"].splitlines() if "node 0 (10.201.0.1)" in line))
    print(f"lost at {measured['left']}, back at {measured['joined']}; kill to a step at 2: "
          f"{[round(t, 2) for t in measured['recover_s']]} s; launch to a step at 4: "
          f"{[round(t, 2) for t in measured['back_s']]} s")
    assert measured["left"] == [2, 5, 8] and measured["joined"] == [4, 7, 10]
    assert len(measured["pids_b"]) == 2 and measured["pids_b"] <= measured["pids_before"]
    _samples_once(grown, complete=True)
    stops = [(2, 2, 2)] + [stop for lost, back in zip([*measured["left"][1:], None], measured["joined"])
                           for stop in ((1, 2, back), (1, 4, lost))]
    _assert_bit_for_bit(_final(grown), _clean_stops(clean, stops))


@needs_netns
@heavy
def test_in_place_the_store_moves_twice_node_0_lost_then_node_1(tmp_path):
    """2 x 1: node 0 killed after step K (the store moves to node 1) and back in place at K + 2; then node 1, which
    holds the store now, killed after step K + 3: node 0's rank moves the store to node 0's own standby and trains
    on alone, its launcher says so (the moved and left lines). Node 1's launcher started again finds the running
    job at node 0's endpoint (node 0's launcher, come back, records it there) and joins in place; both exit 0, bit
    for bit with the clean stops and resumes. Before issue #42, node 0's launcher, having joined, did not follow
    the second move, and node 1 was refused."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    port, paused = 29600 + random.randrange(300), os.path.join(grown, "paused")
    with netns.two_nodes() as (a, b):
        launches = [Launch(a.command(_inplace_argv(0, 1, port, grown, "--pause-at", str(K), "--pause-rank", "0")),
                           clean_env()),
                    Launch(b.command(_inplace_argv(1, 1, port, grown, "--pause-at", str(K + 3), "--pause-rank", "1",
                                                   "--hold-at-world", "1")), clean_env())]
        try:
            _wait_file(paused, 240, launches)
            _kill_node(launches[0])
            _wait_lines(launches[1], NODE_0_LEFT, 1, INPLACE_BOUND_S + 30)
            os.remove(paused)
            launches.append(Launch(a.command(_inplace_argv(0, 1, port, grown, "--hold-at-world", "1")), clean_env()))
            joined = int(_wait_lines(launches[1], NODE_0_JOINED, 1, 120)[0].group(1))
            _wait_file(paused, 240, launches)
            killed_at = _kill_node(launches[1])
            _wait_lines(launches[2], r"lockstep launch: node 1 \(10\.201\.0\.2\) left at step", 1, INPLACE_BOUND_S + 30)
            again = Launch(b.command(_inplace_argv(1, 1, port, grown)), clean_env())
            launches.append(again)
            back = int(_wait_lines(launches[2], r"lockstep launch: node 1 \(10\.201\.0\.2\) joined at step (\d+)", 1,
                                   120)[0].group(1))
            assert again.finish(240) == 0, again.text()[-4000:]
            assert launches[2].finish(240) == 0, launches[2].text()[-4000:]
        finally:
            _kill_the_rest(launches)
    node_0 = "\n".join(launches[2].err)
    assert "node 1 (10.201.0.2) stopped answering; the workers moved their store to node 0" in node_0, node_0[-3000:]
    assert "joins the running job in place" in again.text(), again.text()[-3000:]
    alone = [t for t, _, w, _ in _rows(grown) if w == 1 and t > killed_at]
    print(f"node 0 back at step {joined}; node 1 killed after step {K + 3}: {alone[0] - killed_at:.2f} s to a step "
          f"at world size 1 on node 0; node 1 back at step {back}")
    assert joined == K + 2
    _samples_once(grown, complete=True)
    _assert_bit_for_bit(_final(grown), _clean_stops(clean, [(2, 1, K), (1, 1, K + 2), (1, 2, K + 3), (1, 1, back),
                                                            (1, 2, None)]))


# ---------------------------------------------------------------------------------------------------------
# One job a folder (issue #42): nodes lost and started again in either order, node 0 included. Every launcher that
# survives a change says it in one line; a launcher started again joins the running job in place (a node that had
# joined in place follows the store when node 0 goes, and so finds it again); the folder holds one job's
# checkpoints, whose fence generations (train/fence.py) rise with each membership change.
ANY_LEFT = (r"lockstep launch: node (\d) \(10\.201\.0\.\d\) left at step (\d+): world (\d+) -> (\d+) in ([\d.]+) s, "
            r"0 steps lost$")
ANY_JOINED = (r"lockstep launch: node (\d) \(10\.201\.0\.\d\) joined at step (\d+): world (\d+) -> (\d+) in ([\d.]+) s "
              r"from its launch, the others paused ([\d.]+) s$")
MOVED = r"lockstep launch: node 0 \(10\.201\.0\.1\) stopped answering; the workers moved their store to node 1"
LOSSES = (2, 6)  # the steps after which the first and the second node to go pause (and are killed)


def _fences(directory: str) -> list[tuple[int, str, int]]:
    """(step, job, generation) of every checkpoint in ``directory``, by step."""
    found = []
    for name in os.listdir(directory):
        if name.startswith("ckpt-") and name.endswith(".meta.json"):
            with open(os.path.join(directory, name)) as f:
                meta = json.load(f)
            found.append((meta["step"], meta["fence"]["job"], meta["fence"]["generation"]))
    return sorted(found)


def _lose_each_node_and_start_it_again(directory: str, nproc: int, order: tuple[int, int]) -> dict:
    """2 x ``nproc`` in place, a checkpoint every step. Node ``order[0]`` pauses after step LOSSES[0] and is killed
    (every process); the other goes on alone and holds its first step until the first node's launcher, started
    again with the same command, joins in place. Then node ``order[1]`` pauses after LOSSES[1], is killed, and is
    started again the same way. Both launchers running at the end exit 0. Returns every launch's lines by role."""
    port = 29600 + random.randrange(300)
    hold = ["--hold-at-world", str(nproc), "--save-every", "1"]
    pause = {node: ["--pause-at", str(LOSSES[order.index(node)]), "--pause-here"] for node in (0, 1)}
    with netns.two_nodes() as namespaces:
        def start(node: int, *extra: str) -> Launch:
            return Launch(namespaces[node].command(_inplace_argv(node, nproc, port, directory, *hold, *extra)),
                          clean_env())

        launches = {0: start(0, *pause[0]), 1: start(1, *pause[1])}
        everyone = list(launches.values())
        seen: dict = {"left": [], "joined": [], "first": dict(launches)}
        try:
            for loss, node in enumerate(order):
                other = 1 - node
                _wait_file(os.path.join(directory, "paused"), 240, everyone)
                _kill_node(launches[node])
                left = _wait_lines(launches[other], ANY_LEFT, 1, INPLACE_BOUND_S + 30)[0]
                os.remove(os.path.join(directory, "paused"))
                seen["left"].append((int(left.group(1)), int(left.group(2))))
                launches[node] = start(node)  # the same command, the pause already spent
                everyone.append(launches[node])
                joined = _wait_lines(launches[other], ANY_JOINED, loss + 1, 120)[-1]
                seen["joined"].append((int(joined.group(1)), int(joined.group(2))))
            for node in order:
                assert launches[node].finish(240) == 0, launches[node].text()[-4000:]
        finally:
            _kill_the_rest(everyone)
    seen["last"] = launches
    return seen


def _check_one_job(directory: str, clean: str, nproc: int, order: tuple[int, int], seen: dict) -> None:
    first, second = order
    (gone_1, lost_at_1), (gone_2, lost_at_2) = seen["left"]
    assert (gone_1, gone_2) == order and (lost_at_1, lost_at_2) == LOSSES, seen
    assert [node for node, _ in seen["joined"]] == list(order), seen
    last, firsts = seen["last"], seen["first"]
    # every launcher there at a change said it in one line: the first loss on the other node's first launch, the
    # first return on it and on the returned launch; the second loss and return on the launch that came back
    # first (node 1's, or node 0's when node 0 went first), and on the launch that came back last
    survivor_1, returned_1 = firsts[second], last[first]
    for launch, lines in ((survivor_1, [ANY_LEFT, ANY_JOINED]), (returned_1, [ANY_JOINED, ANY_LEFT, ANY_JOINED]),
                          (last[second], [ANY_JOINED])):
        text = "\n".join(launch.err)
        for pattern in set(lines):
            assert len(re.findall(pattern, text, re.M)) == lines.count(pattern), (pattern, text[-4000:])
    if 0 in order:  # node 0 lost: the launcher that served nothing said where the store went
        holder = survivor_1 if first == 0 else returned_1
        assert re.search(MOVED, "\n".join(holder.err), re.M), "\n".join(holder.err)[-3000:]
    everything = "\n".join(x.text() for x in [*firsts.values(), *last.values()])
    assert "resumed from step" not in everything and "restarted" not in everything, everything[-4000:]
    assert "joins the running job in place" in last[0].text() and "joins the running job in place" in last[1].text()
    # one job's checkpoints, every step's, the generation rising with each of the four membership changes
    fences = _fences(directory)
    assert [s for s, _, _ in fences] == list(range(1, STEPS + 1)), fences
    assert len({job for _, job, _ in fences}) == 1, fences
    generations = [g for _, _, g in fences]
    assert generations == sorted(generations) and generations[0] == 1 and generations[-1] == 5, fences
    _samples_once(directory, complete=True)
    joined_at = [step for _, step in seen["joined"]]
    stops = [(2, nproc, LOSSES[0]), (1, nproc, joined_at[0]), (1, 2 * nproc, LOSSES[1]), (1, nproc, joined_at[1]),
             (1, 2 * nproc, None)]
    _assert_bit_for_bit(_final(directory), _clean_stops(clean, stops))


@needs_netns
@pytest.mark.parametrize("nproc, order", [pytest.param(n, o, marks=heavy) for n, o in
                                          [(1, (1, 0)), (2, (1, 0)), (1, (0, 1)), (2, (0, 1))]])
def test_nodes_lost_and_started_again_in_either_order_make_one_job(tmp_path, nproc, order):
    """Issue #42's sequence (node 1 lost and back in place, then node 0 lost and started again: it began a second
    job into the same folder) and its mirror, at 2 x 1 and 2 x 2 (heavy: ~2.5 min each; the default level's node-0 test
    is test_in_place_node_0_killed_the_others_go_on_and_it_comes_back_in_place): one job throughout,
    bit for bit with the clean stops and resumes."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    seen = _lose_each_node_and_start_it_again(grown, nproc, order)
    print(f"order {order}: left {seen['left']}, joined {seen['joined']}; fences {_fences(grown)}")
    for role, launches in (("first", seen["first"]), ("again", seen["last"])):
        for node, launch in sorted(launches.items()):
            said = [line for line in launch.err if re.search(r"^lockstep launch: node \d", line)]
            print(f"  node {node} ({role} launch, exit {launch.proc.returncode}): " + " | ".join(said))
    _check_one_job(grown, clean, nproc, order, seen)


@needs_netns
@heavy
@pytest.mark.parametrize("back_first", [0, 1])
def test_both_nodes_lost_then_started_again_in_either_order_resume_as_one_job(tmp_path, back_first):
    """2 x 1, a checkpoint every step: both nodes killed while node 0's rank pauses after step 3 (the whole job
    gone). Node ``back_first`` is started again first, the other 15 s later. Node 1 first: it waits for node 0,
    then both form a new round, a new job resumed from step 3 at world size 2. Node 0 first: it resumes alone
    (holding its first step) and node 1 joins it in place. Either way one job at a time: the first job's
    checkpoints, then the new one's, never interleaved, the generation rising; both launchers exit 0; bit for bit
    with the clean stops and resumes."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    os.makedirs(grown)
    os.makedirs(clean)
    port = 29600 + random.randrange(300)
    with netns.two_nodes() as namespaces:
        def start(node: int, *extra: str) -> Launch:
            return Launch(namespaces[node].command(_inplace_argv(node, 1, port, grown, "--save-every", "1", *extra)),
                          clean_env())

        everyone = [start(0, "--pause-at", "3", "--pause-rank", "0"), start(1)]
        try:
            _wait_file(os.path.join(grown, "paused"), 240, everyone)
            _kill_node(everyone[1])
            _kill_node(everyone[0])
            os.remove(os.path.join(grown, "paused"))
            before = _fences(grown)
            first = start(back_first, *(["--hold-at-world", "1"] if back_first == 0 else []))
            everyone.append(first)
            time.sleep(15)
            second = start(1 - back_first)
            everyone.append(second)
            assert second.finish(300) == 0, second.text()[-4000:]
            assert first.finish(300) == 0, first.text()[-4000:]
        finally:
            _kill_the_rest(everyone)
    fences = _fences(grown)
    print(f"node {back_first} back first: {fences}")
    assert before == fences[:3] and [s for s, _, _ in fences] == list(range(1, STEPS + 1)), fences
    jobs = [job for _, job, _ in fences]
    assert len(set(jobs)) == 2 and jobs == sorted(jobs, key=jobs.index), fences  # one after the other
    generations = [g for _, _, g in fences]
    assert generations == sorted(generations) and generations[3] > generations[2], fences
    _samples_once(grown, complete=True)
    if back_first == 0:
        line = re.search(ANY_JOINED, "\n".join(first.err), re.M)
        assert line is not None and line.group(1) == "1", first.text()[-3000:]
        stops = [(2, 1, 3), (1, 1, int(line.group(2))), (1, 2, None)]
    else:
        assert "joins the running job in place" not in first.text() + second.text()
        stops = [(2, 1, 3), (2, 1, None)]
    _assert_bit_for_bit(_final(grown), _clean_stops(clean, stops))


@needs_netns
@heavy
def test_a_newcomer_that_comes_as_the_job_ends_leaves_in_one_line_with_exit_0(tmp_path):
    """Node 0 alone (``--nnodes 1:2``), two steps of 20 s; node 1 started during the last one: its ranks announce
    themselves, but no step boundary follows to admit them. They leave in one line (the job ended at step 2,
    nothing to train here) with exit 0, instead of a store client's error when node 0's store goes."""
    directory, port = str(tmp_path), 29600 + random.randrange(300)
    with netns.two_nodes() as (a, b):
        node_a = Launch(a.command(_inplace_argv(0, 1, port, directory, "--step-sleep", "20", "--max-steps", "2")),
                        clean_env())
        launches = [node_a]
        try:
            _wait_step(directory, 2, 240, launches)
            node_b = Launch(b.command(_inplace_argv(1, 1, port, directory)), clean_env())
            launches.append(node_b)
            assert node_a.finish(120) == 0, node_a.text()[-4000:]
            assert node_b.finish(120) == 0, node_b.text()[-4000:]
        finally:
            _kill_the_rest(launches)
    assert "joins the running job in place" in node_b.text(), node_b.text()[-3000:]
    assert re.search(r"lockstep: the running job at 10\.201\.0\.1:\d+ ended at step 2 before it admitted this process: "
                     r"nothing to train here", node_b.text()), node_b.text()[-3000:]
    assert "Traceback" not in node_b.text() and "joined at step" not in node_a.text()
