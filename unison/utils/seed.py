"""Seeding every random number generator a training run draws from."""

from __future__ import annotations

import random

import torch


def manual_seed(seed: int) -> None:
    """Seeds Python's, NumPy's (when installed) and torch's generators, on CPU and CUDA.

    Use the same seed on every rank: data splits and initial weights then agree, and the
    training sampler still gives each rank its own shard. Per-rank randomness (dropout,
    augmentation) comes from each rank's own generator state as training goes on.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed(seed=...) needs an int, got {type(seed).__name__}: {seed!r}")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
