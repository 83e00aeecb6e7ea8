"""``lockstep launch`` end to end: real agents, real worker processes, real gloo.

Each test runs the launcher as a subprocess with a timeout, so a hang fails the
test instead of stalling the suite. Worker scripts live in tests/launch_scripts/.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from levels import FULL

from lockstep.launch.launcher import LaunchError, launch_function, parse_launch_args

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "launch_scripts")

# Variables that would make the launcher think it runs inside another launcher or a SLURM job.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    env.update(extra)
    return env


# The installed console script, beside this interpreter (pip install -e . puts it there).
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "lockstep")


FAILURES = 5 if FULL else 2  # restarts in a row (test_failures_in_a_row_each_get_a_working_restart)


def run_launch(
    args: list[str], timeout_s: float = 60.0, env: dict | None = None, console_script: bool = False
) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    command = [CONSOLE_SCRIPT] if console_script else [sys.executable, "-m", "lockstep"]
    proc = subprocess.run(
        [*command, "launch", *args],
        capture_output=True, text=True, timeout=timeout_s, env=env or clean_env(), cwd=HERE,
    )
    return proc, time.monotonic() - start


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def expected_master_addr() -> str:
    """The MASTER_ADDR a one-node launch gives its workers: loopback, on every torch.

    lockstep's rendezvous (launch/rendezvous.py) publishes the master address itself; torch's own
    would publish this host's FQDN on torch 2.4 (RendezvousStoreInfo.build has no local_addr there).
    """
    return "127.0.0.1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Independent launches run side by side: each costs seconds of mostly idle start-up and rendezvous."""
    tmp = tmp_path_factory.mktemp("launch")
    with socket.socket() as taken:  # held open for the whole batch: a port the launcher cannot have
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            free_port = free.getsockname()[1]
        jobs = {
            # node 0 of 2, and node 1 never comes
            "lonely_node": ["--nnodes", "2", "--master-addr", "localhost", "--master-port", str(free_port),
                            "--rdzv-timeout", "3", "--nproc-per-node", "1", script("allreduce.py")],
            "end_to_end": ["--nproc-per-node", "2", script("allreduce.py"), "--flag", "x"],
            # the filter is the launcher's: a worker without torch shows it as well (report_env.py)
            "log_rank": ["--nproc-per-node", "2", "--log-rank", "0", script("report_env.py")],
            "taken_port": ["--nproc-per-node", "2", "--master-port", str(port), script("allreduce.py")],
            "restart_once": ["--nproc-per-node", "2", "--max-restarts", "1", script("flaky.py"), str(tmp / "once"), "1"],
            "exhausted": ["--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(tmp / "exhausted_logs"),
                          script("flaky.py"), str(tmp / "twice"), "2"],
            # FAILURES + 1 attempts one after another (~6 s each): beside the others instead of after them
            "failures": ["--nproc-per-node", "2", "--max-restarts", str(FAILURES), script("flaky.py"),
                         str(tmp / "failures"), str(FAILURES)],
        }
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            # --log-rank goes through the `lockstep` console script, the rest through `python -m lockstep`
            futures = {name: pool.submit(run_launch, argv, 180.0, None, name == "log_rank") for name, argv in jobs.items()}
            results = {name: f.result() for name, f in futures.items()}
    results["port"] = port
    results["tmp"] = tmp
    return results


# ---------------------------------------------------------------- success, prefixes, --log-rank


def test_two_ranks_allreduce_end_to_end_with_rank_prefixes(runs):
    proc, _ = runs["end_to_end"]
    assert proc.returncode == 0, proc.stderr
    master = expected_master_addr()
    for rank in (0, 1):
        # the prefix names the rank that actually printed the line: it is not just a counter
        assert (f"[rank{rank}]: allreduce rank={rank} world=2 local_rank={rank} master={master} sum=3 "
                f"args=['--flag', 'x']") in proc.stdout.splitlines()
        assert f"[rank{rank}]: stderr line from rank {rank}" in proc.stderr.splitlines()
    assert "lockstep launch:" not in proc.stderr  # no failure report, no restart notice


def test_log_rank_shows_only_that_rank(runs):
    proc, _ = runs["log_rank"]
    assert proc.returncode == 0, proc.stderr
    assert "[rank0]: report_env rank=0 world=2" in proc.stdout
    assert "[rank0]: report_env stderr rank=0" in proc.stderr
    assert "rank1" not in proc.stdout + proc.stderr and "rank=1" not in proc.stdout


# ---------------------------------------------------------------- failures


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """raises.py on 2 workers, alone (its time is asserted): rank 1 raises, rank 0's all-reduce then fails.

    One launch for the two tests below: the report's form, and what stays off the console (test_launch_reports'
    theme, asserted here to start these three interpreters once).
    """
    log_dir = tmp_path_factory.mktemp("failing_logs")
    proc, elapsed_s = run_launch(["--nproc-per-node", "2", "--log-dir", str(log_dir), script("raises.py")], 60)
    return proc, elapsed_s, log_dir


def test_failing_worker_exits_nonzero_fast_with_one_report(failing):
    proc, elapsed_s, tmp_path = failing
    assert proc.returncode != 0
    # Not gloo's 30-minute timeout nor a rendezvous timeout (300 s): ~5 s alone, 39.5 s in a quiet full run while
    # another file started five 2-node launches beside it (three interpreters to start here, at load ~15)
    assert elapsed_s < 90, f"launcher took {elapsed_s:.1f}s to give up"
    err = proc.stderr.splitlines()
    headers = [i for i, line in enumerate(err) if line.startswith("lockstep launch: worker rank")]
    assert len(headers) == 1, proc.stderr  # reported once
    block = err[headers[0]:]
    assert block[0].startswith("lockstep launch: worker rank 1 (local rank 1")
    assert "failed: exit code 1" in block[0]
    # not interleaved: every line after the header belongs to the indented block
    assert all(line.startswith("  ") for line in block[1:]), block
    text = "\n".join(block)
    assert "RuntimeError: worker exploded on purpose (lockstep launch test)" in text
    assert 'raises.py", line 8' in text  # the traceback, not just the message
    # the full per-rank logs stay where --log-dir said, and the report names the folder
    stderr_logs = list(tmp_path.glob("*/attempt_0/1/stderr.log"))
    assert len(stderr_logs) == 1 and "worker exploded on purpose" in stderr_logs[0].read_text()
    assert f"full logs: {stderr_logs[0].parent.parent}" in text


def test_a_peers_follow_on_error_and_torchs_stop_lines_stay_off_the_console(failing):
    # issue #34 item 6: rank 1 raises; rank 0's all_reduce then fails on the closed connection. Its gloo traceback
    # ("Connection closed by peer ... GLHF!") followed the real one as if it were a second cause, and torch's
    # unprefixed "Sending process N closing signal SIGTERM" line came with it.
    proc, _, _ = failing
    assert proc.returncode == 1, proc.stderr
    assert "GLHF" not in proc.stderr and "closing signal" not in proc.stderr, proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr  # rank 1's, the cause
    lines = proc.stderr.splitlines()
    start = [i for i, line in enumerate(lines) if line.startswith("lockstep launch: worker rank")]
    assert len(start) == 1, proc.stderr
    report = "\n".join(lines[start[0]:])
    assert report.startswith("lockstep launch: worker rank 1 (local rank 1") and "exploded on purpose" in report


def test_report_names_the_cause_when_two_failures_share_a_second(tmp_path):
    # torch stamps a failure in whole seconds: when rank 1 raises and rank 0's collective fails on the
    # closed connection within the same second, torch's "first" failure is rank 0 (the lower rank). The
    # report names the rank whose stderr was last written first (the CI flake that found this: rank 0).
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from lockstep.launch.report import failure_report

    logs = SimpleNamespace(last_dest=SimpleNamespace(stderrs={}))
    failures = {}
    for rank, (text, mtime_s) in enumerate([("RuntimeError: Connection closed by peer", 1_000_000_002.5),
                                            ("RuntimeError: the cause", 1_000_000_002.1)]):
        path = tmp_path / f"attempt_0/{rank}/stderr.log"
        path.parent.mkdir(parents=True)
        path.write_text(text + "\n")
        os.utime(path, (mtime_s, mtime_s))
        logs.last_dest.stderrs[rank] = str(path)
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(tmp_path / "none"))
        failures[rank].timestamp = 1_000_000_002
    error = ChildFailedError("raises.py", failures)
    assert error.get_first_failure()[0] == 0  # torch's pick
    report = failure_report(error, logs)
    assert report.rank == 1 and str(report).startswith("lockstep launch: worker rank 1 (local rank 1"), str(report)
    assert "the cause" in str(report) and "also failed: rank 0 (exit code 1)" in str(report)
    # A worker the agent stopped (SIGTERM) in the same second is not the cause, however early its last write.
    failures[0].exitcode = -signal.SIGTERM
    os.utime(logs.last_dest.stderrs[0], (1_000_000_000.0, 1_000_000_000.0))
    assert failure_report(ChildFailedError("raises.py", failures), logs).rank == 1
    failures[0].timestamp = 1_000_000_001  # a second earlier: the timestamps decide, as torch's
    assert failure_report(ChildFailedError("raises.py", failures), logs).rank == 0


def test_restarts_exhausted_reports_rank_exit_code_and_restarts(runs):
    counter = runs["tmp"] / "twice"
    proc, _ = runs["exhausted"]
    assert proc.returncode == 3, proc.stderr  # the worker's own exit code
    assert counter.read_text() == "2"
    assert "restart 1 of 1" in proc.stderr
    report = proc.stderr[proc.stderr.index("lockstep launch: worker rank 1"):]
    assert "failed: exit code 3, after 1 restart(s)" in report
    assert "failing on purpose: failure 2 of 2" in report


def test_taken_port_fails_fast_naming_the_rendezvous_flags(runs):
    proc, elapsed_s = runs["taken_port"]
    port = runs["port"]
    assert proc.returncode == 1 and elapsed_s < 60  # ~2 s alone; seven launches run side by side here
    assert f"rendezvous at 127.0.0.1:{port} (--master-addr/--master-port) failed" in proc.stderr
    # torch's wording varies: "Address already in use" (errno text, 2.4) or "address already in use" (2.14)
    assert "address already in use" in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_missing_node_fails_after_the_rendezvous_timeout(runs):
    proc, elapsed_s = runs["lonely_node"]
    assert proc.returncode == 1 and elapsed_s < 60
    assert "lockstep launch: node 0 of 2 (flags), 1 workers here" in proc.stderr
    assert "only some of the 2 nodes joined within --rdzv-timeout 3s" in proc.stderr
    assert "allreduce rank=" not in proc.stdout  # no worker started without its peers


# ---------------------------------------------------------------- restarts


def _attempts(stdout: str) -> list[tuple[int, int, str]]:
    """(restart count, rank, all-reduce sum) for every attempt a worker reached the all-reduce in."""
    return [(int(k), int(r), s) for k, r, s in re.findall(r"attempt restart=(\d+) rank=(\d+) sum=(\S+)", stdout)]


def test_max_restarts_1_recovers_from_one_failure(runs):
    counter = runs["tmp"] / "once"
    proc, _ = runs["restart_once"]
    assert proc.returncode == 0, proc.stderr
    assert counter.read_text() == "1"
    assert sorted(_attempts(proc.stdout)) == [(0, 0, "3"), (0, 1, "3"), (1, 0, "3"), (1, 1, "3")]
    assert "completed rank=0 after restart=1" in proc.stdout and "completed rank=1 after restart=1" in proc.stdout
    # the notice says why: which rank, and its exit code and last words
    assert ("lockstep launch: restarting the workers (restart 1 of 1) because worker rank 1 failed (exit code 3)"
            in proc.stderr), proc.stderr


def test_failures_in_a_row_each_get_a_working_restart(runs):
    """The PyTorch #135712 regression: every restarted group must form and all-reduce again (2 failures in a row by
    default, 5 with LOCKSTEP_FULL=1)."""
    counter = runs["tmp"] / "failures"
    proc, elapsed_s = runs["failures"]
    n = FAILURES
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert counter.read_text() == str(n)
    # every attempt 0..n formed a 2-rank gloo group whose all-reduce gave 1 + 2
    assert sorted(_attempts(proc.stdout)) == [(r, k, "3") for r in range(n + 1) for k in range(2)]
    restarts = re.findall(rf"restarting the workers \(restart (\d) of {n}\)", proc.stderr)
    assert [int(r) for r in restarts] == list(range(1, n + 1))
    assert "connectFullMesh" not in proc.stderr
    assert f"completed rank=0 after restart={n}" in proc.stdout and f"completed rank=1 after restart={n}" in proc.stdout
    print(f"{n} restarts took {elapsed_s:.1f}s")


def _sigterm_forever(launch_args: list[str], script_args: list[str], timeout_s: float = 40) -> tuple[Any, str, list[int], float]:
    """Start forever.py on 2 workers, SIGTERM the launcher once both are up; (proc, stderr, pids, seconds to exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "launch", "--nproc-per-node", "2", *launch_args, script("forever.py"), *script_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=HERE,
    )
    try:
        pids = []
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:  # both workers are up once each printed its pid
            match = re.search(r"worker pid (\d+)", proc.stdout.readline())
            if match:
                pids.append(int(match.group(1)))
        assert len(pids) == 2
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=timeout_s)
        took_s = time.monotonic() - sent
    finally:
        proc.kill()
    return proc, err, pids, took_s


def _assert_gone(pids: list[int]) -> None:
    # no orphan keeps running after the launcher is gone (allow init a moment to reap them)
    deadline = time.monotonic() + 5
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _exists(pid)}
        time.sleep(0.1)
    assert not alive, f"workers {sorted(alive)} outlived the launcher"


def test_sigterm_to_the_launcher_stops_every_worker():
    proc, err, pids, _ = _sigterm_forever([], [])
    assert proc.returncode == 128 + signal.SIGTERM
    assert "lockstep launch: stopped by SIGTERM" in err
    _assert_gone(pids)


def test_shutdown_timeout_bounds_a_worker_that_ignores_sigterm():
    """--shutdown-timeout is the preemption grace window: workers that do not finish are SIGKILLed after it."""
    from lockstep.launch.agent import launch_config_fields

    if "shutdown_timeout" not in launch_config_fields():
        with pytest.raises(ValueError, match="--shutdown-timeout needs torch's LaunchConfig.shutdown_timeout"):
            parse_launch_args(["--shutdown-timeout", "3", script("forever.py")])
        return
    proc, err, pids, took_s = _sigterm_forever(["--shutdown-timeout", "3"], ["ignore-sigterm"])
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert 3 <= took_s < 20, f"the launcher exited {took_s:.1f} s after SIGTERM; the window was 3 s"
    _assert_gone(pids)


def test_shutdown_timeout_is_validated_and_reaches_the_agent(tmp_path):
    from lockstep.launch.agent import LaunchOptions, _launch_config, launch_config_fields
    from lockstep.launch.output import RankLogsSpecs

    with pytest.raises(ValueError, match=r"--shutdown-timeout must be in 1\.\.3600 seconds, got 0"):
        LaunchOptions(nproc_per_node=1, shutdown_timeout_s=0)
    if "shutdown_timeout" in launch_config_fields():
        options, _, _ = parse_launch_args(["--shutdown-timeout", "40", script("forever.py")])
        assert _launch_config(options, RankLogsSpecs(str(tmp_path))).shutdown_timeout == 40


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- launch_function (the Python API)


def allreduce_rank(scale: float) -> tuple[int, int, int, float]:
    """Runs in each worker: lockstep.init() from the env the agent set, all-reduce, return what we saw."""
    import torch
    import torch.distributed as dist

    import lockstep

    env = lockstep.init(backend="gloo")
    try:
        t = torch.tensor([scale * (env.rank + 1)])
        dist.all_reduce(t)
        return env.rank, env.local_rank, env.world_size, t.item()
    finally:
        lockstep.shutdown()


def fail_on_rank_1() -> str:
    if int(os.environ["RANK"]) == 1:
        raise KeyError("rank one lost its key")
    return "ok"


def test_launch_function_returns_per_rank_values():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    env_before = dict(os.environ)
    results = launch_function(allreduce_rank, args=(2.0,), nproc_per_node=2)
    assert results == {0: (0, 0, 2, 6.0), 1: (1, 1, 2, 6.0)}
    # the caller's process is left as it was: its signal handlers and environment
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert dict(os.environ) == env_before


def test_launch_function_failure_names_rank_and_error(tmp_path):
    with pytest.raises(LaunchError) as info:  # rank 1 hidden from the console...
        launch_function(fail_on_rank_1, nproc_per_node=2, log_rank=0, log_dir=str(tmp_path))
    assert info.value.rank == 1 and info.value.exitcode != 0
    # ...but its log file still feeds the report
    assert "worker rank 1" in str(info.value) and "KeyError: 'rank one lost its key'" in str(info.value)


def test_launch_function_rejects_unpicklable_functions_and_bad_sizes():
    with pytest.raises(ValueError, match="module-level"):
        launch_function(lambda: 1)
    with pytest.raises(ValueError, match="--nproc-per-node"):
        launch_function(allreduce_rank, args=(1.0,), nproc_per_node=0)


def test_launch_config_passes_only_the_fields_this_torch_has(monkeypatch, tmp_path):
    """torch 2.4's LaunchConfig has no signals_to_handle / shutdown_timeout (2.11: no shutdown_timeout)."""
    import dataclasses

    import torch.distributed.launcher.api as launcher_api

    from lockstep.launch.agent import LaunchOptions, _launch_config
    from lockstep.launch.output import RankLogsSpecs

    options = LaunchOptions(nproc_per_node=2)
    logs = RankLogsSpecs(str(tmp_path))
    current = _launch_config(options, logs)
    newer = {"signals_to_handle", "shutdown_timeout"} & {f.name for f in dataclasses.fields(current)}
    for dropped in ({"signals_to_handle", "shutdown_timeout"}, {"shutdown_timeout"}):
        kept = [f.name for f in dataclasses.fields(launcher_api.LaunchConfig) if f.name not in dropped]
        older = dataclasses.make_dataclass("LaunchConfig", [(n, object, dataclasses.field(default=None)) for n in kept])
        monkeypatch.setattr(launcher_api, "LaunchConfig", older)
        config = _launch_config(options, logs)  # a TypeError here is the bug this guards against
        assert config.nproc_per_node == 2 and config.logs_specs is logs
        assert not dropped & {f.name for f in dataclasses.fields(config)}
    if "shutdown_timeout" in newer:
        assert current.shutdown_timeout == 15
