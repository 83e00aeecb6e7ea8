"""The hang catalogue (issue 11, section 1): every way a DDP job hangs ends, within 2 x hang_timeout_s, in a
report that names the rank the others wait for and the line of its script where it is.

Each case is a real gloo job of separate processes running ``hang_scripts/hang_cases.py`` with the variables
torchrun sets, forked from the test's forkserver (script_ranks.ForkedScript: torch imported once), all cases at
once; one more case runs through ``lockstep launch --hang-timeout`` to check the launcher's side (the report once
in its output, every rank's report beside the logs, exit code 86) with fresh interpreters. The file takes
about a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from script_ranks import ForkedScript

from lockstep.diagnostics.watchdog import HANG_EXIT_CODE
from lockstep.process_group import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "hang_scripts" / "hang_cases.py"
HANG_TIMEOUT_S = 6.0  # a few seconds, with margin for a loaded machine: the healthy cases must never trip it
WORLD = {"data": 3, "skip": 2, "fewer": 2, "extra": 2, "kill": 2, "branch": 2, "raise": 2, "slow": 2, "grad_end": 2}
JOB_LIMIT_S = 240  # a case still running by then has hung for real: it is killed and fails

pytestmark = pytest.mark.timeout(JOB_LIMIT_S + 60)


def line_of(marker: str) -> int:
    """The script line carrying ``# CASE:<marker>``: what a report must point at."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if f"# CASE:{marker}" in line:
            return number
    raise LookupError(marker)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LOCKSTEP_HANG_TIMEOUT_S", None)
    return env


def start_forked(script: Path, case: str, ranks: list[dict[str, str]], logs: Path) -> list[tuple[ForkedScript, Path]]:
    """A case's ranks, forked from the forkserver (what a report says and the code the watchdog exits with do not
    depend on a fresh interpreter; 20 ranks start in ~6 CPU-s instead of ~60): ``ranks`` holds each rank's layout
    variables beside RANK, WORLD_SIZE and the master's; the output of each in ``logs``/CASE.rankR.log."""
    port = free_port()
    procs = []
    for rank, layout in enumerate(ranks):
        env = dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(len(ranks)),
                   LOCKSTEP_LOG_DIR=str(logs / case), **layout)
        out = logs / f"{case}.rank{rank}.log"
        procs.append((ForkedScript(script, [case, str(HANG_TIMEOUT_S)], env, out, ROOT), out))
    return procs


def _start_case(case: str, world: int, logs: Path) -> list[tuple[ForkedScript, Path]]:
    """One node of ``world`` ranks; the launcher's case is a real launch (``jobs``)."""
    return start_forked(SCRIPT, case, [{"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)} for r in range(world)],
                        logs)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """case -> {"rc": [per rank], "out": [per rank], "ended": time the last rank ended, "mark": last MARK time}."""
    logs = tmp_path_factory.mktemp("hang")
    running = {case: _start_case(case, world, logs) for case, world in WORLD.items()}
    launch_dir = logs / "launch"
    with open(logs / "launch.log", "w") as f:
        running["launch"] = [(subprocess.Popen(
            [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", "--hang-timeout", str(HANG_TIMEOUT_S),
             "--log-dir", str(launch_dir), str(SCRIPT), "data", "env"],
            env=_env(), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT), logs / "launch.log")]
    ended: dict[str, float] = {}
    deadline = time.monotonic() + JOB_LIMIT_S
    while len(ended) < len(running) and time.monotonic() < deadline:
        for case, procs in running.items():
            if case not in ended and all(p.poll() is not None for p, _ in procs):
                ended[case] = time.time()
        time.sleep(0.1)
    results = collect(running, ended, logs)
    results["launch"]["dir"] = launch_dir
    return results


def collect(running: dict, ended: dict[str, float], logs: Path) -> dict:
    """case -> {"rc", "out", "ended", "mark", "dir"} once the cases ended: a rank still running (a stopped one, or
    any past the limit) is killed first; "mark" is the last MARK a rank printed (when it misbehaved)."""
    results = {}
    for case, procs in running.items():
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        outs = [path.read_text(errors="replace") for _, path in procs]
        marks = [float(m) for out in outs for m in re.findall(r"^(?:\[rank\d\]:)?MARK ([\d.]+)$", out, re.M)]
        results[case] = {"rc": [p.returncode for p, _ in procs], "out": outs, "ended": ended.get(case),
                         "mark": max(marks, default=None), "dir": logs / case}
    return results


def report_of(job: dict) -> str:
    """The one full report of the job (printed by the rank that raised the alarm), and that there is one."""
    reports = [out for out in job["out"] if "lockstep hang report:" in out]
    assert len(reports) == 1, "expected the full report in exactly one rank's output:\n" + "\n".join(job["out"])
    return reports[0]


def diagnosis(job: dict) -> str:
    return re.search(r"^diagnosis: (.*)$", report_of(job), re.M).group(1)


def assert_ended_in_time(job: dict) -> None:
    assert job["ended"] is not None, "the job did not end"
    assert job["mark"] is not None
    took_s = job["ended"] - job["mark"]
    assert took_s < 2 * HANG_TIMEOUT_S, f"the job ended {took_s:.1f} s after the rank misbehaved (limit {2 * HANG_TIMEOUT_S} s)"


def assert_hang_exit(job: dict) -> None:
    assert job["rc"] == [HANG_EXIT_CODE] * len(job["rc"]), (job["rc"], job["out"])
    assert_ended_in_time(job)
    for rank in range(len(job["rc"])):  # a report on every rank
        assert (job["dir"] / f"hang-report-rank{rank}.txt").read_text().startswith("=" * 20)


def test_rank_stuck_in_data_loading(jobs):
    job = jobs["data"]
    assert_hang_exit(job)
    assert diagnosis(job) == (f"rank 1 has not started forward of step 3 (in data loading at hang_cases.py:{line_of('data')} "
                              "in main); ranks 0, 2 wait in all-reduce of bucket 0 (collective #7) of step 3")
    text = report_of(job)
    # every rank's stacks: rank 1's main thread is in the sleeping data loader
    assert re.search(rf"--- rank 1: .*?\n(?:.*\n)*?.*hang_cases.py\", line {line_of('data')} in main", text)
    assert text.count("--- rank ") == 3
    # the other ranks print one line pointing at their copy
    others = [out for out in job["out"] if "lockstep hang report:" not in out]
    assert all(diagnosis(job) in out and "written to" in out for out in others)


def test_rank_that_skips_a_backward(jobs):
    job = jobs["skip"]
    assert_hang_exit(job)
    assert diagnosis(job) == (
        f"rank 1 has not started forward of step 6 (in torch.distributed.barrier at hang_cases.py:{line_of('end')} in main); "
        f"it skipped a backward: its forward of step 3 was followed by another forward at hang_cases.py:{line_of('forward')} "
        "in main; rank 0 waits in all-reduce of bucket 0 (collective #16) of step 6")


def test_rank_with_one_step_fewer(jobs):
    job = jobs["fewer"]
    assert_hang_exit(job)
    assert diagnosis(job) == (
        f"rank 1 has not started forward of step 6 (in torch.distributed.barrier at hang_cases.py:{line_of('end')} in main); "
        "rank 0 waits in all-reduce of bucket 0 (collective #16) of step 6")


def test_rank_with_an_extra_collective(jobs):
    job = jobs["extra"]
    assert_hang_exit(job)
    assert diagnosis(job) == (
        f"rank 1 has not started forward of step 4 (in torch.distributed.barrier at hang_cases.py:{line_of('extra')} in main); "
        "rank 0 waits in all-reduce of bucket 0 (collective #10) of step 4")


def test_rank_killed_mid_backward(jobs):
    # gloo notices a dead peer at once (the survivor's all-reduce fails): no hang, but the survivor's
    # report names the rank that stopped beating and where the survivor was.
    job = jobs["kill"]
    assert job["rc"][1] == -9 and job["rc"][0] not in (0, HANG_EXIT_CODE), job["rc"]
    assert_ended_in_time(job)
    assert re.search(r"lockstep failure report \(rank 0\): rank 1 stopped responding \(its last heartbeat showed .*\): "
                     rf"it died or is frozen; rank 0 failed in all-reduce of bucket 0 \(collective #7\) of step 3 "
                     rf"\(in the end of backward at hang_cases.py:{line_of('backward')} in main\)", job["out"][0]), job["out"][0]


def test_ranks_whose_models_take_different_branches(jobs):
    # Same shapes (the start-up check passes), but rank 1's forward skips a layer: its parameters get no
    # gradient there. lockstep's reducer launches every bucket anyway and all ranks raise, naming them.
    job = jobs["branch"]
    assert all(rc == 1 for rc in job["rc"]), job["rc"]
    for out in job["out"]:
        assert "parameters received no gradient in this backward" in out and "(rank 1: 'b.weight', 'b.bias')" in out
        assert "lockstep hang report" not in out
        # each rank exited on that same error, as its peer's last record says: no failure report adds to it
        assert "lockstep failure report" not in out, out


def test_rank_that_raises_is_named_with_its_error(jobs):
    # rank 1's forward raises; rank 0's all-reduce then fails on the closed connection. Rank 1's last record
    # says it exited and on what, so rank 0's report names that error instead of "stopped responding".
    # On a loaded machine rank 1's exit may take longer than the hang timeout: rank 0's watchdog then ends it
    # first (86), and the hang report's diagnosis names the same error. Rank 1 keeps its own exit code.
    job = jobs["raise"]
    assert job["rc"][1] == 1 and job["rc"][0] in (1, HANG_EXIT_CODE), job["rc"]
    assert_ended_in_time(job)
    said = r"rank 1 exited on an error of its own \(ValueError: a bad batch on purpose\) in forward of step 3; "
    if job["rc"][0] == 1:
        assert re.search(r"lockstep failure report \(rank 0\): " + said + r"rank 0 failed in all-reduce of bucket 0 "
                         r"\(collective #\d+\) of step 3", job["out"][0]), job["out"][0]
    else:
        assert re.match(said + r"rank 0 waits in all-reduce of bucket 0", diagnosis(job)), diagnosis(job)
    assert "stopped responding" not in job["out"][0] and "lockstep failure report" not in job["out"][1]


def test_clean_exit_inside_a_stale_backward_phase_is_not_reported(jobs):
    # The last backward reduced nothing (torch.autograd.grad), so the phase still reads "backward" at exit, and
    # both ranks exit together without teardown: no failure report (it once said "rank 1 exited without an error").
    job = jobs["grad_end"]
    assert job["rc"] == [0, 0], job["out"]
    for rank, out in enumerate(job["out"]):
        assert f"rank {rank} finished 6 steps" in out and "lockstep failure report" not in out, out


def test_long_healthy_step_is_not_reported(jobs):
    job = jobs["slow"]
    assert job["rc"] == [0, 0], job["out"]
    for rank, out in enumerate(job["out"]):
        assert f"rank {rank} finished 6 steps" in out and "lockstep" not in out.replace("/lockstep", "")


def test_lockstep_launch_hang_timeout(jobs):
    job = jobs["launch"]
    out = job["out"][0]
    assert job["rc"] == [HANG_EXIT_CODE], out
    assert out.count("lockstep hang report:") == 1, out  # once in the launcher's output
    assert f"(in data loading at hang_cases.py:{line_of('data')} in main); rank 0 waits in all-reduce of bucket 0" in out
    assert "exit code 86: its hang watchdog ended it" in out
    # the reports go to this job's own folder under --log-dir (its attempt folder, beside the ranks' logs),
    # which the report line names: a second job into the same --log-dir cannot overwrite them
    folders = {p.parent for p in job["dir"].glob("*/attempt_0/hang-report-rank*.txt")}
    assert len(folders) == 1, list(job["dir"].rglob("*"))
    folder = folders.pop()
    assert sorted(p.name for p in folder.glob("hang-report-rank*.txt")) == ["hang-report-rank0.txt", "hang-report-rank1.txt"]
    assert f"(every rank's report: {folder})" in out or f"written to {folder}/hang-report-rank" in out, out
    assert list(folder.rglob("stderr.log")), "the ranks' logs are kept beside the reports"
