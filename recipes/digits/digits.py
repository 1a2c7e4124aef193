"""Data and model of the digits recipe: 8x8 handwritten digits bundled with scikit-learn."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits  # with the config: a spawned run's ranks fork with it imported
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from unison.distributed import split_dataset


def load_all() -> TensorDataset:
    """The 1,797 digits as (1, 8, 8) float images in [0, 1] and integer labels."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    return TensorDataset(images, labels)


def build_datasets(seed: int, val_fraction: float = 0.2, test_fraction: float = 0.0) -> tuple[Dataset, ...]:
    """Train / validation (/ test) splits, identical on every rank: they depend on ``seed`` only."""
    train_fraction = 1.0 - val_fraction - test_fraction
    parts = split_dataset(
        load_all(), [train_fraction, val_fraction] + ([test_fraction] if test_fraction else []), seed=seed
    )
    return tuple(parts)


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, one pooling, two linear layers: 1x8x8 -> 10 scores."""

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
