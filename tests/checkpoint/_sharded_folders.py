"""Sharded checkpoint folders written in one process, as a save writes them, for the tests of choosing one."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn

from unison.checkpoint.entry import Entry
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.sharded import finish_folder, own_checksums, temp_folder


def save_folder(folder: Path, n: int, model: nn.Module | None = None) -> Entry:
    """A sharded checkpoint written whole, as a save writes it (shards, rest.pt, checksums, rename)."""
    final = folder / f"ckpt-e{n:04d}-i{10 * n:09d}.dcp"
    tmp = temp_folder(final)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        dcp.save({"model": (model or nn.Linear(2, 1)).state_dict()}, checkpoint_id=tmp, no_dist=True)
    meta = {"epoch": n, "iteration": 10 * n, "sharded": ["model"], "sequence": n}
    finish_folder(tmp, final, {"meta": meta, "objects": {}, "trainer": {}}, own_checksums(tmp))
    return Entry(final.name, n, 10 * n, sequence=n)


def checkpoints(tmp_path: Path, saves: int = 2, model: nn.Module | None = None) -> Manifest:
    """A checkpoint folder holding ``saves`` sharded checkpoints, recorded in its manifest."""
    manifest = Manifest(tmp_path / "checkpoints")
    manifest.folder.mkdir()
    for n in range(1, saves + 1):
        manifest.add(save_folder(manifest.folder, n, model))
    manifest.write()
    return manifest
