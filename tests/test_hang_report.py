"""The hang report's words, from records (single process, no group): who waits for whom, and the settings."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest

from lockstep.diagnostics.progress import Progress, ProgressObserver, current_collective, user_location
from lockstep.diagnostics.report import describe, diagnose, failure_report
from lockstep.diagnostics.watchdog import DEFAULT_HANG_TIMEOUT_S, FROM_ENV, resolve_hang_timeout


def rec(step_done, phase, bucket=-1, seq=0, where="train.py:10 in main", collective=None, skipped=None):
    return {"step_done": step_done, "phase": phase, "bucket": bucket, "seq": seq, "numel": 0, "stalled_s": 1.0,
            "where": where, "collective": collective, "skipped_backward": skipped, "wall": 0.0, "beat": 1}


def test_rank_behind_in_data_loading():
    infos = {0: rec(11, "wait", 3, 40), 1: rec(11, "data", where="train.py:57 in main"), 2: rec(11, "wait", 3, 40)}
    assert diagnose(infos, infos, 3) == ("rank 1 has not started forward of step 12 (in data loading at train.py:57 in main); "
                                         "ranks 0, 2 wait in all-reduce of bucket 3 (collective #40) of step 12")


def test_rank_in_forward_or_before_backward():
    infos = {0: rec(4, "wait", 0, 9), 1: rec(4, "forward", collective="all_reduce", where="model.py:20 in forward")}
    assert diagnose(infos, infos, 2).startswith(
        "rank 1 has not finished forward of step 5 (in torch.distributed.all_reduce at model.py:20 in forward)")
    infos[1] = rec(4, "loss")
    assert diagnose(infos, infos, 2).startswith("rank 1 has not started backward of step 5")


def test_rank_steps_behind_and_silent_rank():
    infos = {0: rec(7, "wait", 1, 20), 1: rec(5, "optimizer")}
    records = {**infos, 2: rec(7, "backward", 0, 19)}
    text = diagnose(infos, records, 3)
    assert text.startswith("rank 2 does not respond (last seen in backward of step 8, bucket 0 launched last): it died or is frozen; "
                           "rank 1 is 2 step(s) behind, in optimizer after step 5")
    assert text.endswith("rank 0 waits in all-reduce of bucket 1 (collective #20) of step 8")


def test_ranks_in_different_collectives():
    infos = {0: rec(2, "wait", 2, 8), 1: rec(2, "wait", 1, 7)}
    assert diagnose(infos, infos, 2) == ("rank 1 is in all-reduce of bucket 1 (collective #7) of step 3 instead: the ranks' "
                                         "collectives differ (in the end of backward at train.py:10 in main); "
                                         "rank 0 waits in all-reduce of bucket 2 (collective #8) of step 3")


def test_failure_report_says_what_became_of_each_peer():
    # rank 0's all-reduce failed; rank 1 exited on an error of its own, rank 2 exited cleanly (fewer batches),
    # rank 3 stopped beating. Each peer's last record says which (``Watchdog._note_exit``).
    mine = {**rec(4, "wait", 0, 9), "rank": 0, "stacks": "Traceback ...\nRuntimeError: Connection closed by peer"}
    records = {1: {**rec(4, "forward"), "exited": True, "error": "ValueError: bad batch"},
               2: {**rec(3, "data"), "exited": True, "error": None}, 3: rec(4, "backward", 0, 8)}
    head = failure_report(0, mine, records, [1, 2, 3], 4).splitlines()[1]
    assert head == ("lockstep failure report (rank 0): rank 1 exited on an error of its own (ValueError: bad batch) in "
                    "forward of step 5; rank 2 exited without an error after data loading before step 4; rank 3 "
                    "stopped responding (its last heartbeat showed backward of step 5, bucket 0 launched last): it "
                    "died or is frozen; rank 0 failed in all-reduce of bucket 0 (collective #9) of step 5 (in the "
                    "end of backward at train.py:10 in main)"), head


def test_hang_diagnosis_names_a_peer_that_exited_on_its_own_error():
    infos = {0: rec(2, "wait", 0, 7)}
    records = {**infos, 1: {**rec(2, "forward"), "exited": True, "error": "ValueError: a bad batch"}}
    assert diagnose(infos, records, 2) == ("rank 1 exited on an error of its own (ValueError: a bad batch) in forward "
                                           "of step 3; rank 0 waits in all-reduce of bucket 0 (collective #7) of step 3")


def test_describe_phases():
    assert describe(rec(0, "data")) == "data loading before step 1"
    assert describe(rec(3, "optimizer")) == "optimizer after step 3"


def _bucket(index, seq, done=None, numel=10):
    work = None if done is None else SimpleNamespace(is_completed=lambda: done)
    return SimpleNamespace(index=index, seq=seq, work=work, flat=SimpleNamespace(numel=lambda: numel))


def test_zero2_waits_name_the_reduce_scatter_and_the_all_gather():
    # ZeRO-2 (``ddp.zero2``): the end of backward says what its waits are for; the next forward's all-gathers are
    # named by ``collective``. The bucket waited on is the first whose work has not completed.
    progress = Progress()
    reducer = SimpleNamespace(expect_hooks=False, step=None, buckets=[])
    obs = ProgressObserver(lambda: reducer, progress)
    obs.forward_start()
    obs.forward_end()
    obs.waiting([_bucket(1, 6, done=True), _bucket(2, 7, done=False), _bucket(3, 8, done=False)], "reduce-scatter")
    snap = progress.snapshot()
    assert (snap["phase"], snap["bucket"], snap["seq"], snap["numel"]) == ("wait", 2, 7, 10)
    assert describe({**rec(4, "wait", bucket=2, seq=7), "op": snap["op"]}) == (
        "reduce-scatter of bucket 2 (collective #7) of step 5")
    obs.backward_end(5)
    obs.forward_start()
    obs.collective("all-gather")
    obs.wait_start(0, 3)
    snap = progress.snapshot()
    assert (snap["phase"], snap["bucket"], snap["seq"]) == ("wait", 0, 3)
    record = {**rec(5, "wait", bucket=0, seq=3), "op": snap["op"]}
    assert describe(record) == "all-gather of bucket 0 (collective #3) of the update of step 5"
    obs.wait_end(0, 3)
    assert progress.phase == "forward"  # back to the forward the wait was in (was "backward" before ZeRO-2)
    obs.forward_end()
    assert progress.op == "all-reduce"


def test_progress_reads_the_backward_and_the_bucket_launched_last_from_the_reducer():
    # No event tells the progress that a backward started or a bucket launched (a steady step calls no observer
    # inside backward): the watchdog's read finds them in the reducer of the last forward.
    progress = Progress()
    reducer = SimpleNamespace(expect_hooks=False, step=None, buckets=[_bucket(0, 3), _bucket(1, 4)])
    obs = ProgressObserver(lambda: reducer, progress)
    obs.forward_start()
    obs.forward_end()
    assert progress.phase_now() == "loss" and progress.snapshot()["phase"] == "loss"
    reducer.step = object()  # the backward's start (``Reducer.on_backward_start``)
    snap = progress.snapshot()
    assert (snap["phase"], snap["bucket"]) == ("backward", -1)
    reducer.buckets[1] = _bucket(1, 9, done=False)  # launched in this backward (the last one's works let go)
    snap = progress.snapshot()
    assert (snap["phase"], snap["bucket"], snap["seq"]) == ("backward", 1, 9)
    assert describe({**rec(0, "backward", bucket=1, seq=9)}) == "backward of step 1, bucket 1 launched last"
    reducer.step = None
    obs.backward_end(1)
    assert progress.snapshot()["phase"] == "data"


def test_observer_tracks_phases_and_a_skipped_backward():
    progress = Progress()
    expects = [False]
    obs = ProgressObserver(lambda: SimpleNamespace(expect_hooks=expects[0]), progress)
    obs.forward_start()
    assert progress.phase == "forward"
    obs.forward_end()
    expects[0] = True  # the reducer waits for this forward's backward, which never comes
    obs.forward_start()
    assert progress.skipped_backward[0] == 1 and "test_hang_report.py" in progress.skipped_backward[1]
    obs.backward_start()
    obs.bucket_launch(0, 100, 5)
    obs.wait_start(0, 5)
    assert (progress.phase, progress.bucket, progress.seq) == ("wait", 0, 5)
    obs.backward_end(1)
    assert (progress.phase, progress.step_done) == ("data", 1)
    obs.some_event_added_later(1, 2)  # the seam may grow: unknown events are ignored


def test_user_location_skips_library_frames():
    import sys

    assert user_location(sys._getframe()).startswith("test_hang_report.py:")
    assert current_collective(sys._getframe()) is None


def test_hang_timeout_settings(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_HANG_TIMEOUT_S", raising=False)
    assert resolve_hang_timeout(FROM_ENV) == DEFAULT_HANG_TIMEOUT_S == 300
    monkeypatch.setenv("LOCKSTEP_HANG_TIMEOUT_S", "42")
    assert resolve_hang_timeout(FROM_ENV) == 42.0
    monkeypatch.setenv("LOCKSTEP_HANG_TIMEOUT_S", "0")
    assert resolve_hang_timeout(FROM_ENV) is None
    assert resolve_hang_timeout(None) is None and resolve_hang_timeout(0) is None and resolve_hang_timeout(5) == 5.0
    monkeypatch.setenv("LOCKSTEP_HANG_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"\$LOCKSTEP_HANG_TIMEOUT_S must be a number"):
        resolve_hang_timeout(FROM_ENV)
    with pytest.raises(ValueError, match="hang_timeout_s must be >= 0"):
        resolve_hang_timeout(-1)


def test_trainer_config_and_launcher_flag():
    from lockstep.launch.launcher import _build_parser
    from lockstep.train.config import TrainerConfig

    assert TrainerConfig(hang_timeout_s=30).hang_timeout_s == 30
    with pytest.raises(ValueError, match="TrainerConfig.hang_timeout_s"):
        TrainerConfig(hang_timeout_s=-1)
    assert _build_parser().parse_args(["--hang-timeout", "12", "x.py"]).hang_timeout == 12.0


def test_reports_go_to_a_folder_of_the_job_never_a_shared_one(tmp_path):
    from lockstep.diagnostics.watchdog import report_folder

    # lockstep launch names the job's (attempt's) log folder
    assert report_folder({"LOCKSTEP_LOG_DIR": str(tmp_path / "job")}) == str(tmp_path / "job")
    # torchrun: beside the worker's error file, in torch's per-job attempt folder (a temp folder without --log-dir)
    torchrun = {"TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x1/none_ab12/attempt_2/1/error.json"}
    assert report_folder(torchrun, ("127.0.0.1", 29500)) == "/tmp/torchelastic_x1/none_ab12/attempt_2"
    # neither (env://, mpirun): a folder named by the job, not the machine-wide one every job overwrote
    shared = os.path.join(tempfile.gettempdir(), "lockstep-reports")
    one = report_folder({"TORCHELASTIC_RUN_ID": "run-a"}, ("127.0.0.1", 29500))
    other = report_folder({}, ("127.0.0.1", 29501))
    assert len({one, other, shared}) == 3 and os.path.dirname(one) == shared and "run-a" in one
