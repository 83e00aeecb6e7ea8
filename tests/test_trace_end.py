"""A trace window the run never closes is written when the run ends, and one that never opened says so.

Real 2-rank jobs of a tiny script (``trace_scripts/train_and_end.py``), the cases of issue #28, item 3 (there
with ``examples/debugging.py``, whose transformer only makes it slower): the default window 5..10 and 10 steps
(the window's closing forward never comes) and LOCKSTEP_TRACE_STEPS=2:20 and 6 steps, both written at
``lockstep.shutdown()``; a run that ends at interpreter exit, that raises on every rank with and without
``lockstep.shutdown()`` in ``finally``, and one that never reaches its window. The runs that end at exit or fail
are fresh processes under ``lockstep launch`` (atexit and the launcher stopping the other rank are part of what
they show), three jobs at a time; the two that end in ``lockstep.shutdown()`` run the same script on ranks forked
from dist_utils' forkserver meanwhile (``script_ranks.run_script``: no launcher, no torch import of their own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from script_ranks import run_script

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "tests" / "trace_scripts" / "train_and_end.py")

CASES = {  # name -> (LOCKSTEP_TRACE_STEPS or None, script and its arguments)
    "steps_10": (None, [TINY, "shutdown", "10"]),
    "steps_6": ("2:20", [TINY, "shutdown", "6"]),
    "never_opened": ("20:30", [TINY, "exit", "6"]),
    "exit": ("2:20", [TINY, "exit", "6"]),
    "raise": ("2:20", [TINY, "raise", "6"]),
    "finally": ("2:20", [TINY, "finally", "6"]),
}
FORKED = ("steps_10", "steps_6")  # closed by lockstep.shutdown(): nothing in them needs a fresh process


def _launch(name: str, tmp: Path) -> tuple[int, str]:
    steps, args = CASES[name]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "LOCKSTEP_TRACE": str(tmp / name)}
    env.pop("LOCKSTEP_TRACE_STEPS", None)
    if steps:
        env["LOCKSTEP_TRACE_STEPS"] = steps
    r = subprocess.run([sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", *args], cwd=tmp, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return r.returncode, r.stdout


def _fork(name: str, tmp: Path) -> tuple[int, str]:
    """The script on 2 ranks forked from the forkserver (script_ranks), as ``python SCRIPT ARGS`` runs it."""
    steps, (script, *argv) = CASES[name]
    logs = tmp / f"{name}-logs"
    logs.mkdir()
    env = {"LOCKSTEP_TRACE": str(tmp / name), **({"LOCKSTEP_TRACE_STEPS": steps} if steps else {})}
    r = run_script(script, 2, *argv, log_dir=str(logs), env=env, drop=() if steps else ("LOCKSTEP_TRACE_STEPS",),
                   timeout_s=300)
    if r["rc"]:  # a rank raised or hung: its tracebacks and every rank's output
        return r["rc"], r["err"]
    return 0, "".join((logs / f"{os.path.basename(script)}-rank{rank}.log").read_text() for rank in range(2))


def _result(name: str, tmp: Path, rc: int, output: str) -> dict:
    out = {"rc": rc, "output": output, "dir_exists": (tmp / name).exists(),
           "trace_lines": [line for line in output.splitlines() if "lockstep trace:" in line]}
    for f in ("trace.json", "summary.json"):
        path = tmp / name / f
        out[f] = json.loads(path.read_text()) if path.exists() else None
    out["png"] = (tmp / name / "timeline.png").exists()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace_end")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_launch, name, tmp) for name in CASES if name not in FORKED}
        done = {name: _fork(name, tmp) for name in FORKED}
        done.update({name: f.result() for name, f in futures.items()})
    return {name: _result(name, tmp, *done[name]) for name in CASES}


def _steps(run: dict, rank: int) -> list[int]:
    return sorted(e["args"]["step"] for e in run["trace.json"]["traceEvents"]
                  if e.get("pid") == rank and e["name"] == "forward" and e["ph"] == "X")


def _window(run: dict) -> dict:
    return run["summary.json"]["window"]


def test_default_window_of_a_10_step_run_is_written_at_shutdown(runs):
    r = runs["steps_10"]
    assert r["rc"] == 0, r["output"][-3000:]
    assert r["trace.json"] is not None and r["png"], r["output"][-3000:]
    assert _steps(r, 0) == _steps(r, 1) == [5, 6, 7, 8, 9, 10]
    assert _window(r) == {"requested": [5, 10], "recorded": [5, 10], "missing_ranks": [], "closed_by": "lockstep.shutdown()"}
    assert not [line for line in r["trace_lines"] if "ended" in line]  # the whole window: nothing to warn about


def test_a_run_shorter_than_the_window_writes_what_it_recorded(runs):
    r = runs["steps_6"]
    assert r["rc"] == 0 and r["trace.json"] is not None, r["output"][-3000:]
    assert _steps(r, 0) == _steps(r, 1) == [2, 3, 4, 5, 6]
    assert _window(r)["recorded"] == [2, 6] and _window(r)["closed_by"] == "lockstep.shutdown()"
    [note] = [line for line in r["trace_lines"] if "ended" in line]
    assert "6 synchronised step(s)" in note and "2:20" in note and "LOCKSTEP_TRACE_STEPS" in note and "steps 2..6" in note


def test_a_window_that_never_opened_says_so_in_one_line(runs):
    r = runs["never_opened"]
    assert r["rc"] == 0, r["output"][-3000:]
    assert not r["dir_exists"]
    assert len(r["trace_lines"]) == 1, r["trace_lines"]  # rank 0 only, once
    line = r["trace_lines"][0]
    assert "nothing written" in line and "6 synchronised step(s)" in line and "20:30" in line and "LOCKSTEP_TRACE_STEPS" in line


def test_exit_without_shutdown_writes_the_trace(runs):
    r = runs["exit"]
    assert r["rc"] == 0 and r["trace.json"] is not None, r["output"][-3000:]
    assert _steps(r, 0) == _steps(r, 1) == [2, 3, 4, 5, 6] and _window(r)["closed_by"] == "exit"


@pytest.mark.parametrize("name,closed_by", [("raise", "exit on failure"), ("finally", "lockstep.shutdown() on failure")])
def test_a_failed_run_writes_the_steps_before_the_failure(runs, name, closed_by):
    r = runs[name]
    assert r["rc"] != 0 and "boom at step 3" in r["output"]
    assert r["trace.json"] is not None and r["summary.json"] is not None, r["output"][-3000:]
    assert _steps(r, 0) == _steps(r, 1) == [2, 3]  # both ranks: the launcher stopped none mid-write
    assert _window(r) == {"requested": [2, 20], "recorded": [2, 3], "missing_ranks": [], "closed_by": closed_by}
