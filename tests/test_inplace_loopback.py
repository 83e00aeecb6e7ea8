"""In-place recovery on loopback, no root needed (issue #37): the group re-formed ten times in the same processes
(nothing leaks, nothing changes), ``lockstep.InPlaceRecovery`` in a script's own loop, and an error that comes back
after every re-formation. The runs of a test go side by side: each mostly waits (steps that sleep past the
watcher's poll, a killed rank's loss noticed). The runs under test are fresh processes (``python script`` with the
launcher's variables: real exit codes); the runs they are compared with (no faults) are forked from
tests/dist_utils.py's forkserver (tests/script_ranks.py: ~0.5 CPU-s a rank instead of ~3.5). The namespace runs
are in test_elastic_launch.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from dist_utils import run_ranks
from levels import full_only
from script_ranks import run_script
from test_multinode import clean_env

from lockstep.process_group import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
INPLACE = os.path.join(HERE, "launch_scripts", "inplace_train.py")
LOOP = os.path.join(HERE, "launch_scripts", "inplace_loop.py")


def _without_cxx_frames(out: str) -> str:
    """A worker's output for an assertion message: c10d's warnings carry 20 C++ frames each."""
    return "\n".join(line for line in out.splitlines() if not line.lstrip().startswith("frame #"))[-6000:]


def _start_ranks(script: str, world_size: int, directory: str, *extra: str,
                 port: int | None = None, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """``world_size`` ranks of ``script`` on loopback, in-place recovery on, started now (rank 0 serves the store
    at ``port``)."""
    port = port or free_port()
    return [subprocess.Popen([sys.executable, script, directory, *extra], cwd=HERE, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=clean_env(RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                                           LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), LOCKSTEP_INPLACE="1", **(env or {})))
            for r in range(world_size)]


def _reference(script: str, world_size: int, directory: str, *extra: str) -> None:
    """A run without faults that a test compares with, on ``world_size`` forked ranks (in-place recovery on, as the
    fresh ones); raises with the ranks' tracebacks and output if one failed. Tests run it on a thread beside their
    fresh ranks, whose output they read meanwhile (a full pipe would stall them)."""
    done = run_script(script, world_size, directory, *extra, log_dir=directory, env={"LOCKSTEP_INPLACE": "1"},
                      drop=("TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME"), timeout_s=300)  # clean_env's
    assert done["rc"] == 0, f"reference {os.path.basename(script)} {extra}: {_without_cxx_frames(done['err'])}"


def _finish(procs: list[subprocess.Popen], killed_ok: bool = False) -> list[int]:
    """Each rank's exit code; each must be 0 (or SIGKILL where ``killed_ok``: a rank the run kills itself)."""
    codes = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        codes.append(proc.returncode)
        assert proc.returncode == 0 or (killed_ok and proc.returncode == -signal.SIGKILL), _without_cxx_frames(out)
    return codes


@full_only("~45 s: ten re-formations in one process; one is test_in_place_recovery_in_a_plain_loop")
def test_in_place_ten_recoveries_in_one_process_leak_nothing_and_change_nothing(tmp_path):
    """Rank 0 raises the alarm after 10 steps: every rank drops its collectives and the group re-forms (same size,
    same processes) 10 times. Threads, sockets and descriptors stay as after the first re-formation, RSS within
    a few MiB, and the parameters equal, bit for bit, a run without alarms."""
    alarmed, quiet = str(tmp_path / "alarmed"), str(tmp_path / "quiet")
    os.makedirs(alarmed)
    os.makedirs(quiet)
    # each step waits out more than the watcher's poll (BEAT_S, 0.2 s), so every alarm re-forms the group at the
    # next step: on a quiet machine steps of a few ms let 3 alarms span the whole run
    procs = _start_ranks(INPLACE, 2, alarmed, "--alarms", "10", "--epochs", "4", "--step-sleep", "0.5")
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference, INPLACE, 2, quiet, "--epochs", "4")
        _finish(procs)
        reference.result()
    for name in (n for n in os.listdir(alarmed) if n.startswith("resources-")):
        with open(os.path.join(alarmed, name)) as f:
            rows = [line.split() for line in f]  # step world generation threads sockets fds rss_mib
        assert [int(r[2]) for r in rows] == list(range(11)), rows
        first, last = rows[1], rows[-1]
        print(f"{name}: after re-formation 1: {first[3:]}; after 10: {last[3:]} (threads sockets fds RSS MiB)")
        assert first[3:6] == last[3:6], (first, last)
        assert float(last[6]) - float(first[6]) < 8, (first, last)
    got, want = (torch.load(os.path.join(d, "ckpt-000000024.pt"), weights_only=True) for d in (alarmed, quiet))
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), key


def test_in_place_recovery_in_a_plain_loop(tmp_path):
    """lockstep.InPlaceRecovery in a script's own loop: 3 ranks, rank 2 killed after step 3; the two others go on
    in their processes, every sample of each epoch once. With alarms instead (the same size), the parameters equal
    a run without, bit for bit."""
    killed, alarmed, quiet, rolled = (str(tmp_path / name) for name in ("killed", "alarmed", "quiet", "rolled"))
    for d in (killed, alarmed, quiet, rolled):
        os.makedirs(d)
    runs = [_start_ranks(LOOP, 3, killed, "--die-at", "3", "--die-rank", "2"),
            _start_ranks(LOOP, 2, alarmed, "--alarms", "3"),
            _start_ranks(LOOP, 2, rolled, "--commit-fails-at", "5", "--commit-fails-rank", "1")]
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference, LOOP, 2, quiet)
        assert _finish(runs[0], killed_ok=True) == [0, 0, -signal.SIGKILL]
        _finish(runs[1])
        outputs = [proc.communicate(timeout=300)[0] for proc in runs[2]]
        reference.result()
    # Rank 1's commit of step 5 completed and then failed: rank 0 had committed 5 and loses step 6; rank 1 applies 5
    # itself (roll forward) and returns from step(), so the script's scheduler.step() and log ran for step 5 on both
    # ranks (when step() raised instead, rank 1's LR schedule fell a step behind and the parameters differed)
    assert [proc.returncode for proc in runs[2]] == [0, 0], _without_cxx_frames("\n".join(outputs))
    assert "re-formed after step 5, rolled forward: True" in outputs[1], _without_cxx_frames(outputs[1])
    assert "re-formed after step 5, rolled forward: False" in outputs[0], _without_cxx_frames(outputs[0])
    each_sample_once(rolled)
    got = torch.load(os.path.join(rolled, "final.pt"), weights_only=True)
    want = torch.load(os.path.join(quiet, "final.pt"), weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    records = each_sample_once(killed)
    assert {r["world"] for r in records if r["step"] > 3} == {2}
    got, want = (torch.load(os.path.join(d, "final.pt"), weights_only=True) for d in (alarmed, quiet))
    assert all(torch.equal(got[k], want[k]) for k in want)


def _rows(directory: str) -> list[tuple[float, int, int, int]]:
    """(time, step, world size, pid) of every step every process of launch_scripts/inplace_loop.py finished."""
    rows = []
    for name in (n for n in os.listdir(directory) if n.startswith("progress-")):
        with open(os.path.join(directory, name)) as f:
            rows += [(float(t), int(s), int(w), int(p)) for t, s, w, p in (line.split() for line in f)]
    return sorted(rows)


def each_sample_once(directory: str, epochs: int = 2, n: int = 48) -> list[dict]:
    """launch_scripts/inplace_loop.py's per-step records in ``directory``, every process's; asserts each epoch saw
    each sample exactly once."""
    records = []
    for name in (n for n in os.listdir(directory) if n.startswith("samples-")):
        with open(os.path.join(directory, name)) as f:
            records += [json.loads(line) for line in f]
    for epoch in range(epochs):
        ids = [i for r in records if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(n)), f"epoch {epoch}: a sample twice or none"
    return records


def _start_newcomer(directory: str, port: int, base: int) -> subprocess.Popen:
    """What ``lockstep launch`` starts on a node that comes back to a running in-place job (launch/rendezvous.py's
    ``_join_running``): the same script, a round of its own (rank 0 of 1), and LOCKSTEP_INPLACE_JOIN."""
    join = json.dumps({"base": base, "node": {"node_rank": 1, "addr": "127.0.0.1", "host": "loopback"},
                       "t0": time.time()})
    return subprocess.Popen([sys.executable, LOOP, directory], cwd=HERE, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            env=clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCKSTEP_INPLACE="1",
                                          LOCKSTEP_INPLACE_JOIN=join))


def test_a_plain_loop_takes_a_newcomer_in_place_and_equals_clean_stops_and_resumes(tmp_path):
    """lockstep.InPlaceRecovery admits a process that joins the running job (issue #37 item 2, a script's loop):
    2 ranks, rank 1 killed after step 13 (in the second epoch); rank 0 goes on alone and holds its first step at
    world size 1 until a newcomer (the same script, started as lockstep launch starts a node that comes back) waits;
    the next step boundary admits it: it takes parameters, optimizer state, step and data position from rank 0 over
    the group (its LR scheduler's too: a StepLR whose steps do not fall on the grow step), its loop skips the
    finished epoch, rank 0 keeps its process, each epoch's samples once, and the final
    parameters equal, bit for bit, a run stopped cleanly at step 13 on 2 ranks, resumed on 1, stopped at the grow
    step and resumed on 2."""
    grown, clean = str(tmp_path / "grown"), str(tmp_path / "clean")
    for d in (grown, clean):
        os.makedirs(d)
    port = free_port()
    procs = _start_ranks(LOOP, 2, grown, "--die-at", "13", "--die-rank", "1", "--hold-at-world", "1", port=port)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(_reference, LOOP, 2, clean, "--max-steps", "13")  # its first stop needs no result
        deadline = time.monotonic() + 120
        while not any(w == 1 for _, _, w, _ in _rows(grown)):  # rank 0 holds its first step at world size 1
            assert time.monotonic() < deadline and procs[0].poll() is None, _without_cxx_frames(procs[0].stdout.read())
            time.sleep(0.1)
        started = time.time()
        newcomer = _start_newcomer(grown, port, base=2)
        assert _finish([*procs, newcomer], killed_ok=True) == [0, -signal.SIGKILL, 0]
        reference.result()
    rows = _rows(grown)
    grow_step = max(s for _, s, w, _ in rows if w == 1)
    first = min(t for t, s, w, p in rows if w == 2 and p == newcomer.pid)
    survivor = procs[0].pid
    paused = (min(t for t, s, _, p in rows if p == survivor and s == grow_step + 1)
              - max(t for t, s, _, p in rows if p == survivor and s == grow_step))
    print(f"newcomer: start to its first step at world size 2: {first - started:.2f} s; rank 0's step that admitted "
          f"it: {paused:.2f} s (grew after step {grow_step})")
    last = max(s for _, s, _, _ in rows)
    assert {s for _, s, w, p in rows if p == newcomer.pid} == set(range(grow_step + 1, last + 1))
    assert {w for _, _, w, p in rows if p == newcomer.pid} == {2}
    with open(os.path.join(grown, f"samples-{newcomer.pid}.jsonl")) as f:
        assert {json.loads(line)["epoch"] for line in f} == {1}  # epoch 0 was done when it joined: nothing there
    each_sample_once(grown)
    for size, extra in ((1, ["--max-steps", str(grow_step)]), (2, [])):
        _reference(LOOP, size, clean, *extra)
    got, want = (torch.load(os.path.join(d, "final.pt"), weights_only=True) for d in (grown, clean))
    assert all(torch.equal(got[k], want[k]) for k in want)


REPEATING_ERROR = """
import os, torch.distributed as dist
from lockstep.process_group import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
from lockstep.train.inplace import InPlaceGroup
group = InPlaceGroup()
error = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
for attempt in range(5):
    try:
        outcome = group.rejoin(error)
        print("re-formed", outcome.generation, outcome.world_size, outcome.committed)
    except RuntimeError as e:
        print(e)
        break
group.stop()
dist.destroy_process_group()
"""


def _repeating_error(rank: int, world_size: int) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(REPEATING_ERROR, {"__name__": "__main__"})
    return printed.getvalue()


def test_an_error_that_repeats_after_every_re_formation_is_raised():
    """A gloo error that is a bug (it comes back at the same step) must not re-form the group for ever."""
    [printed] = run_ranks(_repeating_error, 1, init=False, timeout_s=120)  # forked: one rank makes its own group
    lines = printed.splitlines()
    assert lines[:3] == ["re-formed 1 1 0", "re-formed 2 1 0", "re-formed 3 1 0"], printed
    assert lines[3] == ("lockstep: in-place recovery: re-formed 3 times at step 0 without a step done; the error is "
                        "not a lost peer")


def test_a_stuck_rank_is_named_by_the_hang_report_at_gloos_timeout_not_a_bare_gloo_error(tmp_path):
    """Under in-place recovery a rank that is stuck in its own code (alive: its heartbeat goes on, so no alarm
    re-forms the group) held the others until gloo's per-operation timeout, which ended them with "RuntimeError:
    Application timeout caused pair closure" and a traceback (tried as a user, 2026-11-26: a --nnodes 1:2 launch
    with one rank sleeping after step 3). Now that timeout raises the hang alarm: every rank writes its hang report,
    which names the stuck rank and its line, and the job ends with exit 86, as after hang_timeout_s. With the
    watchdog off (hang_timeout_s=0) the waiting rank raises a named error instead."""
    import re

    from lockstep.keys import INPLACE_TIMEOUT_ENV as TIMEOUT_ENV

    procs = _start_ranks(INPLACE, 2, str(tmp_path / "a"), "--pause-at", "3", "--pause-rank", "1",
                         env={TIMEOUT_ENV: "6"})
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outs.append(proc.communicate()[0] + "\n(killed by the test: still running after 120 s)")
    assert [proc.returncode for proc in procs] == [86, 86], "\n".join(map(_without_cxx_frames, outs))
    assert ("lockstep hang report: rank 0 waited 6 s in a collective after step 3 (gloo's timeout in an in-place "
            "run: LOCKSTEP_INPLACE_TIMEOUT_S) while every rank still beats: a rank is stuck, not lost") in outs[0]
    assert re.search(r"diagnosis: rank 1 has not started forward of step 4 \(.*inplace_train\.py:\d+ in on_step_end",
                     outs[0]), _without_cxx_frames(outs[0])
    assert "Application timeout" not in outs[0], _without_cxx_frames(outs[0])

    procs = _start_ranks(INPLACE, 2, str(tmp_path / "b"), "--pause-at", "3", "--pause-rank", "1",
                         env={TIMEOUT_ENV: "6", "LOCKSTEP_HANG_TIMEOUT_S": "0"})
    try:
        out = procs[0].communicate(timeout=180)[0]
    finally:
        procs[1].kill()
        procs[1].communicate(timeout=30)
    assert procs[0].returncode == 1, _without_cxx_frames(out)
    assert ("RuntimeError: lockstep: in-place recovery: rank 0 waited 6 s in a collective after step 3 (gloo's "
            "timeout in an in-place run: LOCKSTEP_INPLACE_TIMEOUT_S) while every rank still beats: a rank is stuck, "
            "not lost; in-place recovery re-forms around lost ranks only") in out, _without_cxx_frames(out)


def test_both_of_gloos_timeout_texts_are_read_as_a_timeout():
    """The stuck-rank path above starts from gloo's timeout, which says so in two ways: the pair that waited gets
    "Timed out waiting", and the test above may see either. Before, the first was read as a lost peer (the
    survivors then waited 60 s to drop one rank of a node), the second as a bug in the step (raised bare)."""
    from lockstep.train.inplace.regroup import timed_out as _timed_out

    assert _timed_out(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                   "6000ms for recv operation to complete"))
    assert _timed_out(RuntimeError("Application timeout caused pair closure"))
    assert not _timed_out(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                                       "peer [127.0.0.1]:41517"))
    assert not _timed_out(ValueError("timeout"))
