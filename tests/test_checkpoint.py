"""Checkpoint files: atomic writes under a failing save, keep-last-K, safe loading, RNG round trips."""

from __future__ import annotations

import os
import random

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
