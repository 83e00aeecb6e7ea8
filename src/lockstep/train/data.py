"""Small real data sets for the demo, examples and tests, read from files bundled with scikit-learn.

The digits and wine tables are CSV files inside the scikit-learn package: no download, so the demo runs on
machines without network. The digits are read from that file directly (``digits_arrays``), without importing
scikit-learn: its import (scipy with it) costs about 1 CPU-s in every rank of every run, as much as importing
torch again, for a 1,797-row table. Splits are seeded, so every rank (each process loads its own copy) sees the
same train/test partition.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset


def _split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(n)  # a local generator: the global numpy RNG is untouched
    n_test = max(1, round(n * test_fraction))
    return order[n_test:], order[:n_test]


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_digits(return_X_y=True)``: (1797, 64) float64 pixels 0..16 and int64 labels, read
    from the package's ``datasets/data/digits.csv.gz`` as ``load_digits`` reads it, without importing
    scikit-learn. Where that file is not (another layout), ``load_digits`` itself."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits data set is the copy bundled with scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits

        pixels, labels = load_digits(return_X_y=True)
        return pixels, labels.astype(np.int64)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def digits_datasets(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Handwritten digits, 1,797 images of 8x8 pixels in 10 classes, as (N, 1, 8, 8) floats in [0, 1]."""
    pixels, target = digits_arrays()
    images = torch.tensor(pixels.reshape(-1, 1, 8, 8), dtype=torch.float32) / 16.0  # pixel values are 0..16
    labels = torch.tensor(target, dtype=torch.long)
    train, test = _split(len(labels), test_fraction, seed)
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def wine_datasets(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Wine recognition, 178 samples of 13 features in 3 classes, standard-scaled with the training split's
    statistics."""
    from sklearn.datasets import load_wine
    from sklearn.preprocessing import StandardScaler

    bunch = load_wine()
    train, test = _split(len(bunch.target), test_fraction, seed)
    scaler = StandardScaler().fit(bunch.data[train])  # fitted on training data only: no test leakage
    features = torch.tensor(scaler.transform(bunch.data), dtype=torch.float32)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    return TensorDataset(features[train], labels[train]), TensorDataset(features[test], labels[test])
