"""Small real data sets for the demo, examples and tests, read from files bundled with scikit-learn.

``load_digits`` and ``load_wine`` read CSV files inside the scikit-learn package: no
download, so the demo runs on machines without network. Splits are seeded, so every
rank (each process loads its own copy) sees the same train/test partition.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset


def _split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(n)  # a local generator: the global numpy RNG is untouched
    n_test = max(1, round(n * test_fraction))
    return order[n_test:], order[:n_test]


def digits_datasets(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Handwritten digits, 1,797 images of 8x8 pixels in 10 classes, as (N, 1, 8, 8) floats in [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    labels = torch.tensor(bunch.target, dtype=torch.long)
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
