"""The run folder's fence (train/fence.py): one job a checkpoint folder, a stale writer refused before it writes.

The claims are files in a real folder and the holders real processes (a child that claims and renews the lease,
then is killed -9); a job's workers' store is a real listening socket. The Trainer's side (the claim before the
first step, the check before each save, the refusal of a second ``lockstep launch --standalone`` into a running
job's folder, a stale writer's last save refused on every rank) runs real launches on gloo.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from lockstep.train import fence as fence_module
from lockstep.train.fence import FENCE_DIR, JobFence, JobFenceError, StaleGenerationError

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launch_scripts", "inplace_train.py")

HOLDER = textwrap.dedent("""
    import sys, time
    from lockstep.train.fence import JobFence
    fence = JobFence(sys.argv[1], sys.argv[2])
    print(fence.claim(sys.argv[3]), flush=True)
    time.sleep(600)
""")


@pytest.fixture
def listening():
    """A live 'workers' store': a socket that accepts connections."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _holder(directory, job: str, store: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), job, store], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "1"  # it claimed generation 1
    return proc


def test_generations_rise_for_one_job_and_a_released_lease_is_taken_at_once(tmp_path):
    a = JobFence(tmp_path, "job-a")
    assert a.claim("h:1") == 1 and a.claim("h:1") == 2  # its own job again (workers restarted): the next one
    a.check(5)
    a.release()
    b = JobFence(tmp_path, "job-b")
    started = time.monotonic()
    assert b.claim("h:2") == 3 and time.monotonic() - started < 1.0  # released: no wait
    b.release()
    assert sorted(os.listdir(tmp_path / FENCE_DIR)) == [f"gen-00000{g}.json" for g in (1, 2, 3)]


def test_a_live_job_whose_store_answers_refuses_a_second_one_in_one_line(tmp_path, listening):
    proc = _holder(tmp_path, "job-a", listening)
    try:
        started = time.monotonic()
        with pytest.raises(JobFenceError) as refused:
            JobFence(tmp_path, "job-b").claim("h:2")
        assert time.monotonic() - started < 5.0
        message = str(refused.value)
        assert "\n" not in message
        assert re.search(rf"checkpoint_dir {re.escape(str(tmp_path))} is being trained into by job job-a \(generation "
                         rf"1, its workers' store {listening}, writer pid {proc.pid} on .+, lease touched [\d.]+ s "
                         r"ago\); its store answers: starting here would be a second job", message), message
        assert [f for f in os.listdir(tmp_path / FENCE_DIR)] == ["gen-000001.json"]  # nothing taken
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_killed_on_this_machine_is_provably_dead_and_its_lease_taken_at_once(tmp_path, listening):
    proc = _holder(tmp_path, "job-a", listening)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.monotonic()
    assert JobFence(tmp_path, "job-b").claim("h:2") == 2  # its lease is fresh, but its pid is gone
    assert time.monotonic() - started < 1.0


def _foreign_claim(directory, generation: int, store: str) -> None:
    """A claim by a process of another machine (another boot id): liveness is only its lease's age."""
    folder = directory / FENCE_DIR
    folder.mkdir(exist_ok=True)
    (folder / f"gen-{generation:06d}.json").write_text(json.dumps(
        {"job": "job-far", "store": store, "host": "far", "boot": "another-boot", "pid": 1, "pid_start": "1",
         "claimed_at": time.time()}))


def test_a_fresh_lease_of_another_machine_whose_store_is_silent_is_waited_out(tmp_path, monkeypatch):
    monkeypatch.setattr(fence_module, "LEASE_S", 1.5)
    _foreign_claim(tmp_path, 4, "127.0.0.1:9")  # nothing listens on the discard port here
    started = time.monotonic()
    assert JobFence(tmp_path, "job-b").claim("h:2") == 5  # once the lease went stale (no beat)
    assert 1.0 < time.monotonic() - started < 5.0


def test_a_lease_still_renewed_with_a_silent_store_is_refused_after_the_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(fence_module, "LEASE_S", 1.5)
    _foreign_claim(tmp_path, 1, "127.0.0.1:9")
    path = tmp_path / FENCE_DIR / "gen-000001.json"
    stop = time.monotonic() + 10

    def renew():
        while time.monotonic() < stop:
            os.utime(path)
            time.sleep(0.2)

    import threading

    threading.Thread(target=renew, daemon=True).start()
    with pytest.raises(JobFenceError, match=r"its lease is renewed but its store does not answer \(waited 2 s\)"):
        JobFence(tmp_path, "job-b").claim("h:2")
    stop = 0


def test_a_passed_writer_is_refused_before_it_writes_and_cannot_advance(tmp_path, listening):
    old = JobFence(tmp_path, "job-a")
    assert old.claim(listening) == 1
    _foreign_claim(tmp_path, 2, "10.0.0.9:29500")  # the lease went stale (a cut link) and another job claimed it
    with pytest.raises(StaleGenerationError) as refused:
        old.check(41)
    age = re.search(r"touched ([\d.]+) s", str(refused.value)).group(1)
    assert str(refused.value) == (
        f"checkpoint_dir {tmp_path}: this writer (job job-a, generation 1) was passed: the folder is now held by job "
        f"job-far (generation 2, its workers' store 10.0.0.9:29500, writer pid 1 on far, lease touched {age} s ago); "
        "refusing to write the checkpoint of step 41")
    assert not old.advance(listening)  # a re-formation of the passed job takes nothing either
    with pytest.raises(StaleGenerationError):
        old.check(42)
    old.release()


def _launch(directory, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lockstep", "launch", "--standalone", "--nproc-per-node", "2",
                             SCRIPT, str(directory), "--save-every", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE)


def _wait_for(path, timeout_s: float, procs) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "\n".join(p.stdout.read() for p in procs if p.poll() is not None)
        time.sleep(0.2)


def _meta(directory) -> list[dict]:
    return sorted((json.load(open(directory / n)) for n in os.listdir(directory) if n.endswith(".meta.json")),
                  key=lambda m: m["step"])


def test_a_second_standalone_launch_into_a_running_jobs_folder_is_refused_and_the_first_finishes(tmp_path):
    """The same command twice into one folder: the second (it would resume from the first's checkpoint and train
    beside it) ends in one line naming the running job and its store, exit 1, within 60 s; the first job trains on
    to the end, exit 0, and every checkpoint in the folder is its own."""
    go = tmp_path.parent / f"{tmp_path.name}-go"  # the first job holds after step 2 until the second is done
    first = _launch(tmp_path, "--hold-until", str(go))
    try:
        _wait_for(tmp_path / "ckpt-000000002.meta.json", 180, [first])
        started = time.monotonic()
        second = _launch(tmp_path)
        out, _ = second.communicate(timeout=120)
        go.touch()
        assert second.returncode == 1, out
        assert time.monotonic() - started < 60
        # the launcher's account of the failure ends in the one line (the workers' tracebacks are above it)
        said = out.splitlines()[out.splitlines().index(next(line for line in out.splitlines()
                                                            if line.startswith("lockstep launch: worker rank"))):]
        assert any(re.match(r"\s*lockstep\.train\.fence\.JobFenceError: checkpoint_dir .* is being trained into by "
                            r"job \w+ \(generation 1, its workers' store 127\.0\.0\.1:\d+, writer pid \d+ on .*\); "
                            r"its store answers: starting here would be a second job writing into it\. Join that job",
                            line) for line in said), out
        # every rank refused alike (rank 0's verdict, broadcast): both ranks' own last line names it
        assert set(re.findall(r"\[rank(\d)\]: lockstep\.train\.fence\.JobFenceError: checkpoint_dir", out)) == {"0", "1"}, out
        out, _ = first.communicate(timeout=240)
        assert first.returncode == 0, out
    finally:
        first.kill()
    metas = _meta(tmp_path)
    assert [m["step"] for m in metas] == list(range(1, 13)) and len({m["fence"]["job"] for m in metas}) == 1
    assert {m["fence"]["generation"] for m in metas} == {1}


def test_a_stale_writer_is_refused_before_its_next_save_on_every_rank(tmp_path):
    """A running job whose folder another job claimed (as after its lease went stale): its next save raises
    StaleGenerationError on every rank (whatever on_save_error says), the launcher ends non-zero, and no
    checkpoint of a later step is written."""
    job = _launch(tmp_path, "--step-sleep", "1.5")
    try:
        _wait_for(tmp_path / "ckpt-000000002.meta.json", 180, [job])
        _foreign_claim(tmp_path, 2, "10.0.0.9:29500")
        claimed_after = max(m["step"] for m in _meta(tmp_path))
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode != 0, out
    assert re.search(r"StaleGenerationError: checkpoint_dir .*: this writer \(job \w+, generation 1\) was passed: "
                     r"the folder is now held by job job-far \(generation 2", out), out
    assert out.count("StaleGenerationError: checkpoint_dir") >= 2, out  # rank 0 and rank 1 alike
    assert max(m["step"] for m in _meta(tmp_path)) <= claimed_after + 1, out  # at most the save already underway
