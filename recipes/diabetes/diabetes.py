"""Regression on the diabetes data bundled with scikit-learn (442 patients, 10 features).

Features come standardised by scikit-learn; the target (disease progression after one
year) is standardised with the training split's mean and spread, so MSE is in units of
the target's variance.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset

from unison.distributed import split_dataset


def build_datasets(seed: int, val_fraction: float = 0.2, test_fraction: float = 0.1) -> tuple[Dataset, ...]:
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    features = torch.tensor(x, dtype=torch.float32)
    target = torch.tensor(y, dtype=torch.float32).unsqueeze(1)
    fractions = [1 - val_fraction - test_fraction, val_fraction] + ([test_fraction] if test_fraction else [])
    parts = split_dataset(TensorDataset(features, target), fractions, seed=seed)
    train_idx = parts[0].indices
    mean, std = target[train_idx].mean(), target[train_idx].std()
    scaled = TensorDataset(features, (target - mean) / std)
    return tuple(Subset(scaled, part.indices) for part in parts)


def mlp(hidden: int = 64, dropout: float = 0.1) -> nn.Module:
    """10 features -> one standardised prediction."""
    return nn.Sequential(
        nn.Linear(10, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )
