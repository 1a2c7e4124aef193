"""Data and model of the digits recipe: 8x8 handwritten digits bundled with scikit-learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from unison.distributed import split_dataset


def digits_file() -> Path:
    """scikit-learn's copy of the UCI digits: 1,797 rows of 64 pixel values (0 to 16) and a label.

    Found without importing ``sklearn.datasets``, which imports SciPy and more: 1.3 s of every
    process that plans the recipe (the launcher, and each rank under torchrun), for one file."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the digits recipe reads the digits that ship with scikit-learn, and found "
            f"{'no scikit-learn' if path is None else f'no {path}'}: pip install 'unison[recipes]'"
        )
    return path


def load_all() -> TensorDataset:
    """The 1,797 digits as (1, 8, 8) float images in [0, 1] and integer labels, as
    ``sklearn.datasets.load_digits`` gives them."""
    table = np.loadtxt(digits_file(), delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :64]).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.from_numpy(table[:, 64].astype(np.int64))
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
