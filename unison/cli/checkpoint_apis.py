"""Probes of the torch internals unison's checkpoints rely on (listed in :mod:`unison.cli.private_apis`).

Each returns None when the installed torch behaves as relied on, else what changed; the registry
runs each with warnings silenced and an exception taken for the change it shows.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "dcp_bytes_hook",
    "layout_by_name",
    "metadata_allow_list",
    "one_pass",
    "optim_init",
    "rank_files",
    "record_crcs",
    "tiny_dcp",
]


def tiny_dcp(folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # per_thread_copy_ahead=0: CPU tensors, no copy from a device ahead of the write
    writer = dcp.FileSystemWriter(str(folder), per_thread_copy_ahead=0)
    dcp.save({"w": torch.arange(4.0), "lr": 0.5}, storage_writer=writer, no_dist=True)


def metadata_allow_list() -> str | None:
    from unison.checkpoint.sharded_check import read_metadata

    with tempfile.TemporaryDirectory(prefix="unison-probe-") as tmp:
        tiny_dcp(Path(tmp))
        try:
            metadata = read_metadata(Path(tmp))
        except Exception as err:  # the allow-list refused a class this torch writes
            return f"a .metadata written by this torch does not read with unison's allow-list ({err})"
    if set(getattr(metadata, "state_dict_metadata", {})) != {"w", "lr"}:
        return "a .metadata written by this torch lists other keys than those saved"
    return None


def dcp_bytes_hook() -> str | None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    seen: list[bytes] = []

    class Recording(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            data = value.read()
            seen.append(data)
            super().load_bytes(read_item, io.BytesIO(data))

    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="unison-probe-") as tmp:
        tiny_dcp(Path(tmp))
        _load_state_dict(state, storage_reader=FileSystemReader(tmp), planner=Recording(), no_dist=True)
    if len(seen) != 1:
        return f"DCP read {len(seen)} non-tensor values through the planner's load_bytes where 1 was stored"
    if state.get("lr") != 0.5 or not torch.equal(state.get("w", torch.empty(0)), torch.arange(4.0)):
        return "_EmptyStateDictLoadPlanner no longer builds the stored state from the metadata"
    return None


def layout_by_name() -> str | None:
    from torch.serialization import _get_layout

    return None if _get_layout("torch.strided") is torch.strided else "it no longer maps 'torch.strided'"


def optim_init() -> str | None:
    from torch import nn
    from torch.distributed.checkpoint import state_dict as module

    from unison.checkpoint.optim_init import init_once

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps: list[None] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(None))
    if not callable(getattr(module, "_init_optim_state", None)):
        return "torch.distributed.checkpoint.state_dict has no _init_optim_state"
    with init_once():
        for _ in range(2):
            module.get_optimizer_state_dict(model, optimizer)
    if len(steps) != 1:
        return f"get_optimizer_state_dict stepped a stateless SGD {len(steps)} times inside init_once, where 1 was expected"
    return None


def record_crcs() -> str | None:
    import io
    import zipfile

    from unison.checkpoint.record_crcs import records_without_crcs

    buffer = io.BytesIO()
    with records_without_crcs():
        torch.save(torch.ones(4), buffer)
    crcs = {info.CRC for info in zipfile.ZipFile(buffer).infolist()}
    if crcs != {0}:
        return "torch.save computed its records' CRC-32s inside records_without_crcs (it no longer reads get_crc32_options)"
    return None


def one_pass() -> str | None:
    import os

    from unison.checkpoint import archive_load
    from unison.checkpoint.archive_reader import reading_pool

    w, b = torch.arange(3000.0), torch.ones(3)  # past the tail's 4 KiB: w's local header is answered
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "a.pt"
        torch.save({"w": w, "b": b, "n": 1}, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            with reading_pool(1) as pool:
                loaded = archive_load._read_in_one_pass(fd, None, True, None, str(path), pool)
        finally:
            os.close(fd)
    if loaded is archive_load._AS_BEFORE:
        return "torch.load asked a file object for bytes other than an archive's head, tail, local headers and whole records"
    same = torch.equal(loaded["w"], w) and torch.equal(loaded["b"], b) and loaded["n"] == 1
    return None if same else "an archive read in one pass did not load back equal"


def rank_files() -> str | None:
    from unison.checkpoint.dcp_files import check_results

    return check_results()


def kept_staging() -> str | None:
    from unison.checkpoint.dcp_staging import check_staging

    return check_staging()
