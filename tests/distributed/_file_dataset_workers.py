"""Zarr graph stores, their reader and pre_transform, and the rank function of
tests/distributed/test_file_dataset.py.

Each store holds one group per graph (``graph_<i>``) with node features ``x`` [n, 2], an edge
list ``edges`` [2, e] and a label ``y`` [1]. The reader writes a marker file per call when
given a folder, so a test counts the calls made in any process (ranks, workers).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

zarr = pytest.importorskip("zarr")  # zarr 3: Python 3.11 and newer (also when --doctest-modules imports this)
pytest.importorskip("torch_geometric")
from torch_geometric.data import Data  # noqa: E402

from unison.distributed.file_dataset import FileDataset  # noqa: E402


def write_store(path: Path, sizes: list[int], seed: int, nan_at: int | None = None) -> Path:
    """A zarr store of ``len(sizes)`` graphs, graph ``i`` with ``sizes[i]`` nodes in a chain."""
    rng = np.random.default_rng(seed)
    root = zarr.open_group(str(path), mode="w")
    for i, n in enumerate(sizes):
        group = root.create_group(f"graph_{i}")
        x = rng.standard_normal((n, 2)).astype(np.float32)
        if i == nan_at:
            x[0, 1] = np.nan
        group.create_array("x", data=x)
        group.create_array("edges", data=np.stack([np.arange(n - 1), np.arange(1, n)]).astype(np.int64))
        group.create_array("y", data=np.array([float(n % 2)], dtype=np.float32))
    return path


@dataclass
class GraphReader:
    """``reader(path, index)``: graph ``index`` of the store as a dict of numpy arrays."""

    calls: str | None = None

    def __call__(self, path: Path, index: int) -> dict[str, Any]:
        if self.calls is not None:
            Path(self.calls, f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        group = zarr.open_group(str(path), mode="r")[f"graph_{index}"]
        return {name: group[name][:] for name in ("x", "edges", "y")}


def to_graph(raw: dict[str, Any]) -> Data:
    return Data(
        x=torch.from_numpy(raw["x"]), edge_index=torch.from_numpy(raw["edges"]), y=torch.from_numpy(raw["y"])
    )


def to_graph_doubled(raw: dict[str, Any]) -> Data:
    data = to_graph(raw)
    data.x = data.x * 2
    return data


def at_least_three_nodes(raw: dict[str, Any]) -> bool:
    return raw["x"].shape[0] >= 3


@dataclass
class Pair:
    """An item class of the user's own: loads only when allowed by ``safe_globals``."""

    x: torch.Tensor
    y: torch.Tensor


def to_pair(raw: dict[str, Any]) -> Pair:
    return Pair(torch.from_numpy(raw["x"]), torch.from_numpy(raw["y"]))


def digest(item: Data) -> str:
    """A hash of every tensor of a graph, by attribute name."""
    h = hashlib.sha256()
    for key in sorted(item.keys()):
        value = item[key]
        h.update(key.encode())
        h.update(repr((value.dtype, tuple(value.shape))).encode())
        h.update(value.contiguous().numpy().tobytes())
    return h.hexdigest()


def file_dataset_on_rank(files: list[str], output: str, calls: str, broken: str) -> dict[str, Any]:
    """Builds the dataset on this rank; returns whether it preprocessed, a hash per item, and
    the error this rank got from a dataset whose preprocessing fails (on rank 0, where it runs)."""
    try:
        FileDataset([broken], GraphReader(), output=output + "-broken", pre_transform=to_graph)
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    data = FileDataset(
        files,
        GraphReader(calls),
        output=output,
        pre_transform=to_graph,
        pre_filter=at_least_three_nodes,
        chunksize=2,
    )
    return {"built": data.built, "digests": [digest(data[i]) for i in range(len(data))], "error": error}
