"""Checkpoint files: atomic writes under a failing save, keep-last-K, safe loading, RNG round trips."""

from __future__ import annotations

import errno
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from lockstep.train import checkpoint as ckpt


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("refuses to be pickled")


class Payload:
    """A class a malicious or careless checkpoint might carry: weights_only must refuse to build it."""

    def __init__(self):
        self.x = 1


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = ckpt.checkpoint_path(tmp_path, 5)
    ckpt.save_atomic({"format": ckpt.FORMAT, "step": 5, "weights": torch.arange(3)}, path)
    # a large tensor first, so bytes really hit the temporary file before pickling fails
    with pytest.raises(RuntimeError, match="refuses to be pickled"):
        ckpt.save_atomic({"format": ckpt.FORMAT, "big": torch.zeros(1 << 16), "bad": Unpicklable()}, path)
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, ckpt.meta_path(path).name])
    assert ckpt.verify(path) is None
    payload = ckpt.load_checkpoint(path)
    assert payload["step"] == 5 and torch.equal(payload["weights"], torch.arange(3))


def test_list_ignores_temporaries_and_prune_keeps_the_newest(tmp_path):
    for step in (1, 20, 3, 100):
        ckpt.save_atomic({"format": ckpt.FORMAT, "step": step}, ckpt.checkpoint_path(tmp_path, step))
    (tmp_path / ".ckpt-000000200.pt.tmp-123").write_bytes(b"half a checkpoint")  # a writer that died mid-write
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 3, 20, 100]
    assert ckpt.latest_checkpoint(tmp_path).name == "ckpt-000000100.pt"
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in deleted) == ["ckpt-000000001.pt", "ckpt-000000003.pt"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 100]
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        ckpt.prune_checkpoints(tmp_path, keep_last=0)
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None


def test_loading_never_unpickles_code(tmp_path):
    path = tmp_path / "ckpt-000000001.pt"
    torch.save({"format": ckpt.FORMAT, "payload": Payload()}, path)  # plain torch.save, arbitrary class inside
    with pytest.raises(RuntimeError, match=r"could not be read safely \(weights_only=True\)"):
        ckpt.load_checkpoint(path)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)
    with pytest.raises(ValueError, match="is not a lockstep Trainer checkpoint"):
        ckpt.load_checkpoint(other)
    with pytest.raises(FileNotFoundError, match="does-not-exist.pt does not exist"):
        ckpt.load_checkpoint(tmp_path / "does-not-exist.pt")


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)
    state = ckpt.capture_rng_state()
    expected = (torch.rand(4), np.random.rand(3), np.random.normal(), random.random(), random.gauss(0, 1))
    path = ckpt.save_atomic({"format": ckpt.FORMAT, "rng": state}, tmp_path / "ckpt-000000001.pt")
    torch.manual_seed(9), np.random.seed(9), random.seed(9)  # scramble everything
    ckpt.restore_rng_state(ckpt.load_checkpoint(path)["rng"])
    again = (torch.rand(4), np.random.rand(3), np.random.normal(), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


# ---------------------------------------------------------------- integrity and full disks (issue 12, section 2)


def _three_checkpoints(directory):
    for step in (1, 2, 3):
        ckpt.save_atomic({"format": ckpt.FORMAT, "step": step, "w": torch.full((4096,), float(step))},
                         ckpt.checkpoint_path(directory, step))
    return [ckpt.checkpoint_path(directory, step) for step in (1, 2, 3)]


@pytest.mark.parametrize("damage, reason", [
    ("flip", "checksum mismatch"),
    ("truncate", "truncated: "),
    ("empty", "zero-length file: 0 bytes on disk"),
    ("no_meta", "no metadata file ckpt-000000003.meta.json (its save never finished)"),
    ("bad_meta", "its metadata ckpt-000000003.meta.json is unreadable"),
])
def test_damaged_newest_checkpoint_is_told_by_its_checksum_and_skipped(tmp_path, damage, reason):
    first, second, newest = _three_checkpoints(tmp_path)
    data = newest.read_bytes()
    if damage == "flip":
        newest.write_bytes(data[:100] + bytes([data[100] ^ 0x80]) + data[101:])
    elif damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        newest.write_bytes(b"")
    elif damage == "no_meta":
        ckpt.meta_path(newest).unlink()
    else:
        ckpt.meta_path(newest).write_text("{not json")
    assert ckpt.verify(second) is None
    assert reason in ckpt.verify(newest)
    good, skipped = ckpt.newest_good_checkpoint(tmp_path)
    assert good == second and skipped == [(newest, ckpt.verify(newest))]


def test_prune_removes_metadata_and_stale_temporaries_are_cleared(tmp_path):
    _three_checkpoints(tmp_path)
    (tmp_path / ".ckpt-000000004.pt.tmp-999").write_bytes(b"torn")
    ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert ckpt.remove_stale_temporaries(tmp_path) == [tmp_path / ".ckpt-000000004.pt.tmp-999"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003.meta.json", "ckpt-000000003.pt"]


def _small_filesystem(path) -> str | None:
    """A 2 MiB tmpfs at ``path`` (root), or None."""
    path.mkdir()
    if os.geteuid() != 0:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], capture_output=True)
    return str(path) if done.returncode == 0 else None


def test_full_disk_names_path_and_free_space_and_keeps_the_previous_checkpoint(tmp_path):
    small = tmp_path / "small"
    mounted = _small_filesystem(small)
    try:
        if mounted:
            _full_disk_case(small)
        else:
            # no tmpfs: a file-size limit (RLIMIT_FSIZE) gives EFBIG instead, in a child process
            code = ("import resource, sys, pathlib; sys.path.insert(0, sys.argv[2]); import test_checkpoint as t\n"
                    "try: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
                    "except (ValueError, OSError): print('RLIMIT-UNSUPPORTED'); sys.exit(0)\n"
                    "t._full_disk_case(pathlib.Path(sys.argv[1]))")
            done = subprocess.run([sys.executable, "-c", code, str(small), os.path.dirname(__file__)],
                                  capture_output=True, text=True, timeout=120)
            if "RLIMIT-UNSUPPORTED" in done.stdout:
                pytest.skip("neither a tmpfs mount (needs root) nor RLIMIT_FSIZE is available here")
            assert done.returncode == 0, done.stderr
    finally:
        if mounted:
            subprocess.run(["umount", mounted], check=False)


def _full_disk_case(directory):
    small = ckpt.save_atomic({"format": ckpt.FORMAT, "step": 1, "w": torch.zeros(1000)},
                             ckpt.checkpoint_path(directory, 1))
    with pytest.raises(ckpt.CheckpointSaveError) as info:
        ckpt.save_atomic({"format": ckpt.FORMAT, "step": 2, "w": torch.zeros(1 << 20)},  # 4 MiB: does not fit
                         ckpt.checkpoint_path(directory, 2))
    message = str(info.value)
    assert f"checkpoint {ckpt.checkpoint_path(directory, 2)} could not be written" in message
    assert re.search(r"\((\d+\.\d) MB free on the file system of .* once the partial file was removed\); ", message)
    assert message.endswith("the previous checkpoint ckpt-000000001.pt is intact")
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG)
    assert sorted(p.name for p in directory.iterdir()) == ["ckpt-000000001.meta.json", "ckpt-000000001.pt"]
    assert ckpt.verify(small) is None


def test_prune_looks_only_at_its_own_runs_checkpoints(tmp_path):
    # issue 28, item 1: a 1-epoch run (step 23) into the folder of a 2-epoch run (step 46) deleted its own
    # checkpoint and kept the old run's, since pruning kept the newest step across runs
    ckpt.save_atomic({"format": ckpt.FORMAT, "step": 46, "run_id": "old"}, ckpt.checkpoint_path(tmp_path, 46))
    ckpt.save_atomic({"format": ckpt.FORMAT, "step": 12, "run_id": "new"}, ckpt.checkpoint_path(tmp_path, 12))
    ckpt.save_atomic({"format": ckpt.FORMAT, "step": 23, "run_id": "new"}, ckpt.checkpoint_path(tmp_path, 23))
    assert ckpt.checkpoint_run_id(ckpt.checkpoint_path(tmp_path, 23)) == "new"
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=1, run_id="new")
    assert [p.name for p in deleted] == ["ckpt-000000012.pt"]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [23, 46]  # its own newest and the other run's
