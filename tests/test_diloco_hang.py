"""A DiLoCo rank stuck in the outer all-reduce (a peer that stopped without dying: SIGSTOP) is named by the hang
report DDP's hangs get, within the same bound: the fragment, the bucket and the inner step it was launched after.

Real gloo jobs of separate Python processes running ``hang_scripts/diloco_hang.py`` (as test_hang.py runs its
catalogue), both cases at once to share the start-up time: 2 ranks one a node, and 4 ranks as 2 nodes x 2 (where a
node's other rank waits in the node's broadcast of the stuck bucket). No ``DiLoCoConfig.timeout_s``: the watchdog
alone ends the job. The stopped rank never answers and is killed by the test once the others have ended.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from script_ranks import ForkedScript
from test_hang import HANG_TIMEOUT_S, collect, diagnosis, report_of, start_forked

from lockstep.diagnostics import report
from lockstep.diagnostics.progress import Progress, ProgressObserver
from lockstep.diagnostics.watchdog import HANG_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "hang_scripts" / "diloco_hang.py"
CASES = {"one_a_node": ([0, 1], 1), "two_a_node": ([0, 0, 1, 1], 3)}  # node ids by rank, the rank that stops
JOB_LIMIT_S = 180

pytestmark = pytest.mark.timeout(JOB_LIMIT_S + 60)


def _line_of(marker: str) -> int:
    for number, line in enumerate(SCRIPT.read_text().splitlines(), start=1):
        if f"# CASE:{marker}" in line:
            return number
    raise LookupError(marker)


def _start(case: str, logs: Path) -> list[tuple[ForkedScript, Path]]:
    """The case's ranks laid out as its nodes, forked as test_hang's."""
    node_ids, _ = CASES[case]
    return start_forked(SCRIPT, case, [{"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": str(node_ids.count(node)),
                                        "GROUP_RANK": str(node)} for r, node in enumerate(node_ids)], logs)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """case -> {"rc", "out", "ended" (the last running rank's end), "mark" (when the peer stopped), "dir"}."""
    logs = tmp_path_factory.mktemp("diloco_hang")
    running = {case: _start(case, logs) for case in CASES}
    ended: dict[str, float] = {}
    deadline = time.monotonic() + JOB_LIMIT_S
    while len(ended) < len(running) and time.monotonic() < deadline:
        for case, procs in running.items():
            stopped = CASES[case][1]
            if case not in ended and all(p.poll() is not None for r, (p, _) in enumerate(procs) if r != stopped):
                ended[case] = time.time()
        time.sleep(0.1)
    return collect(running, ended, logs)  # the stopped rank killed: the others have ended


def _assert_hang_exit(job: dict, stopped: int) -> None:
    assert job["ended"] is not None and job["mark"] is not None, job["out"]
    took_s = job["ended"] - job["mark"]
    assert took_s < 2 * HANG_TIMEOUT_S, f"the job ended {took_s:.1f} s after the peer stopped"
    for rank, rc in enumerate(job["rc"]):
        assert rc == (-signal.SIGKILL if rank == stopped else HANG_EXIT_CODE), (job["rc"], job["out"])
        if rank != stopped:  # every rank that answers writes its report
            assert (job["dir"] / f"hang-report-rank{rank}.txt").read_text().startswith("=" * 20)


def test_one_rank_a_node_names_the_outer_all_reduce(jobs):
    job = jobs["one_a_node"]
    _assert_hang_exit(job, stopped=1)
    outer = ("DiLoCo's outer all-reduce of fragment 0, bucket 1 of 4 (launched after inner step 5, waited for after "
             "inner step 5)")
    assert diagnosis(job) == ("rank 1 does not respond (last seen in data loading before step 5): it died or is "
                               f"frozen; rank 0 waits in {outer}")
    text = report_of(job)
    assert re.search(rf"lockstep hang report: rank 0 waited [\d.]+ s \(hang_timeout_s=6\) in {re.escape(outer)}",
                     text), text
    # the table: rank 0's position and where in the script it waits
    assert re.search(rf"^   0  {re.escape(outer)} +[\d.]+s  DiLoCo's outer sync at diloco_hang.py:{_line_of('sync')} "
                     "in main$", text, re.M), text


def test_two_ranks_a_node_name_the_all_reduce_and_the_node_broadcast(jobs):
    job = jobs["two_a_node"]
    _assert_hang_exit(job, stopped=3)
    launched = "of fragment 0, bucket 2 of 2 (launched after inner step 4, waited for after inner step 5)"
    said = diagnosis(job)
    assert said.startswith("rank 3 does not respond (last seen in data loading before step 5): it died or is "
                                f"frozen; rank 0 waits in DiLoCo's broadcast inside the node of the outer all-reduce "
                                f"{launched}; rank 2 is 1 step(s) behind, in all-reduce of bucket "), said
    assert said.endswith(f"rank 1 waits in DiLoCo's outer all-reduce {launched}"), said


def test_progress_says_the_outer_wait_and_restores_the_phase():
    progress = Progress()
    observer = ProgressObserver(lambda: None, progress)
    progress.set_phase("optimizer")
    observer.outer_wait(1, 3, 4, 8, 9, "all-reduce")
    snap = progress.snapshot()
    assert snap["phase"] == "outer" and report.describe(snap) == (
        "DiLoCo's outer all-reduce of fragment 1, bucket 3 of 4 (launched after inner step 8, waited for after inner "
        "step 9)")
    observer.outer_wait(1, 3, 4, 8, 9, "broadcast")
    assert report.describe(progress.snapshot()).startswith("DiLoCo's broadcast inside the node of the outer all-reduce")
    observer.outer_end()
    assert progress.phase == "optimizer" and progress.snapshot()["outer"] is None
