"""Sharded checkpoint folders written in one process, as a save writes them, for the tests of choosing one;
and a writer whose results reach DCP's finish() without unison's (a torch that withholds them)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix

from unison.checkpoint.entry import Entry
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.sharded import finish_folder, temp_folder
from unison.checkpoint.sharded_files import file_checksum


class _AsRank(FileSystemWriter):
    """DCP's writer in one process, naming its data file as rank ``rank`` of a run would
    (``__<rank>_0.distcp``), its ``.metadata`` pointing there."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path)
        self.as_rank = rank

    def prepare_local_plan(self, plan: Any) -> Any:
        return dataclasses.replace(
            super().prepare_local_plan(plan), storage_data=_StoragePrefix(f"__{self.as_rank}_")
        )


def save_folder(folder: Path, n: int, model: nn.Module | None = None, writer: int = 0) -> Entry:
    """A sharded checkpoint written whole, as a save writes it (shards, rest.pt, checksums, rename);
    its data file is named as rank ``writer`` would name it."""
    final = folder / f"ckpt-e{n:04d}-i{10 * n:09d}.dcp"
    tmp = temp_folder(final)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        state = {"model": (model or nn.Linear(2, 1)).state_dict()}
        dcp.save(state, storage_writer=_AsRank(tmp, writer), no_dist=True)
    meta = {"epoch": n, "iteration": 10 * n, "sharded": ["model"], "sequence": n}
    finish_folder(
        tmp,
        final,
        {"meta": meta, "objects": {}, "trainer": {}},
        {name: file_checksum(tmp / name) for name in sorted(os.listdir(tmp))},
    )
    return Entry(final.name, n, 10 * n, sequence=n)


def checkpoints(tmp_path: Path, saves: int = 2, model: nn.Module | None = None, writer: int = 0) -> Manifest:
    """A checkpoint folder holding ``saves`` sharded checkpoints, recorded in its manifest (their
    data files named as rank ``writer`` would name them)."""
    manifest = Manifest(tmp_path / "checkpoints")
    manifest.folder.mkdir()
    for n in range(1, saves + 1):
        manifest.add(save_folder(manifest.folder, n, model, writer))
    manifest.write()
    return manifest


def results_only(self: Any, plan: Any, planner: Any) -> Any:
    """``DirectWriter.write_data`` as a DCP that would hand finish() its write results only: no
    checksums, no finite check (patch it in to see what rank 0 does without them)."""
    return FileSystemWriter.write_data(self, plan, planner)
