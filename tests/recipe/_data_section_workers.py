"""A QuantumGrav-shaped user module for the ``data`` section, the zarr stores it reads, and the
rank function of tests/recipe/test_data_section.py.

Each store holds one group per graph (``graph_<i>``): node features ``x`` [n, 2] and a label
``y`` [1]. ``USER_MODULE`` is written beside a test's config: its functions are the user's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")  # zarr 3: Python 3.11 and newer (also when --doctest-modules imports this)

USER_MODULE = """
import torch
import zarr


def read_data(store, idx, float_dtype, int_dtype, validate_data):
    group = zarr.open_group(store, mode="r")[f"graph_{idx}"]
    return {
        "x": torch.tensor(group["x"][:], dtype=float_dtype),
        "y": torch.tensor(group["y"][:], dtype=int_dtype),
        "checked": validate_data,
    }


def read(path, index):
    return read_data(zarr.storage.LocalStore(str(path), read_only=True), index, torch.float32, torch.int64, True)


def read_three(store, idx, dtype):
    return None


def collect_data(sample):
    return {"x": sample["x"], "y": sample["y"]}


def big_enough(sample):
    return sample["x"].shape[0] >= 2
"""


def write_store(path: Path, sizes: list[int], seed: int) -> Path:
    """A zarr store of ``len(sizes)`` graphs, graph ``i`` with ``sizes[i]`` nodes."""
    rng = np.random.default_rng(seed)
    root = zarr.open_group(str(path), mode="w")
    for i, n in enumerate(sizes):
        group = root.create_group(f"graph_{i}")
        group.create_array("x", data=rng.standard_normal((n, 2)).astype(np.float32))
        group.create_array("y", data=np.array([n % 2], dtype=np.int32))
    return path


def split_on_rank(config_path: str) -> dict[str, Any]:
    """One rank: loads and resolves the config, builds its datasets; the indices of each split."""
    from unison.config import load_config
    from unison.recipe.planning.resolved import resolve

    config = load_config(config_path)
    parts = resolve(config).data_build(seed=config.training.seed)
    return {"indices": [list(p.indices) for p in parts], "built": parts[0].dataset.built}
