"""A sharded checkpoint's tensor items read straight into their shards (unison.checkpoint.dcp_reads).

The truth is DCP's own read of the same folder: whatever is read in place, the states must
end equal to it; what this reader does not take is left to DCP, in order.
"""

from __future__ import annotations

import io
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType

import unison.checkpoint.archive_load as archive_load
import unison.checkpoint.dcp_reads as dcp_reads
from unison.checkpoint.dcp_files import DirectWriter
from unison.checkpoint.safe_dcp import safe_load


def _spy(monkeypatch) -> list[tuple[bool, tuple, int]]:
    """Each read_window call of the reader: whether it came back in the shard's own memory, its
    shape, and which threads read it (the same for every item of one load)."""
    seen: list[tuple[bool, tuple, int]] = []
    real = dcp_reads.read_window

    def spy(fd, offset, length, *, verify=True, into=None, pool=None):
        loaded = real(fd, offset, length, verify=verify, into=into, pool=pool)
        seen.append((loaded is into.tensors, tuple(loaded.shape), id(pool) if pool is not None else 0))
        return loaded

    monkeypatch.setattr(dcp_reads, "read_window", spy)
    return seen


def test_a_folders_tensors_load_into_their_own_memory_and_equal_dcps_read(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    saved = {
        "w": torch.randn(300_000, generator=gen),  # 1.2 MB: read in place
        "m": torch.randn(700, 500, generator=gen).to(torch.bfloat16),  # 0.7 MB: left to DCP
        "b": torch.randn(10, generator=gen),
        "step": 3,
    }
    dcp.save(saved, storage_writer=DirectWriter(tmp_path), no_dist=True)
    mine = {
        "w": torch.zeros(300_000),
        "m": torch.zeros(700, 500, dtype=torch.bfloat16),
        "b": torch.zeros(10),
        "step": 0,
    }
    pointers = {k: v.data_ptr() for k, v in mine.items() if isinstance(v, torch.Tensor)}
    seen = _spy(monkeypatch)
    monkeypatch.setattr(archive_load, "IN_PLACE_FROM", 1 << 20)
    safe_load(mine, tmp_path, no_dist=True)

    for key in ("w", "m", "b"):
        assert torch.equal(mine[key], saved[key]) and mine[key].data_ptr() == pointers[key]
    assert mine["step"] == 3
    assert [(placed, shape) for placed, shape, _ in seen] == [(True, (300_000,))]  # the items under
    # 1 MiB were left to DCP's own loop

    dcps = {
        "w": torch.zeros(300_000),
        "m": torch.zeros(700, 500, dtype=torch.bfloat16),
        "b": torch.zeros(10),
        "step": 0,
    }
    monkeypatch.setattr(dcp_reads, "read_in_place", lambda folder, data, plan, planner: list(plan.items))
    safe_load(dcps, tmp_path, no_dist=True)  # DCP's own loop, the truth
    assert all(torch.equal(mine[k], dcps[k]) for k in ("w", "m", "b"))


def _item(
    path: str, offset: int, length: int, *, lengths, offsets=None, transform=None, kind=LoadItemType.TENSOR
):
    index = _Index(f"t@{offset}")
    item = SimpleNamespace(
        type=kind, storage_index=index, storage_offsets=offsets or [0] * len(lengths), lengths=lengths
    )
    where = SimpleNamespace(relative_path=path, offset=offset, length=length, transform_descriptors=transform)
    return item, where


class _Index(NamedTuple):
    """As DCP's MetadataIndex: a hashable key of ``storage_data``."""

    fqn: str


class _Planner:
    def __init__(self, targets):
        self.targets = targets
        self.committed = []

    def resolve_tensor(self, item):
        return self.targets[item.storage_index.fqn]

    def commit_tensor(self, item, tensor):
        self.committed.append((item.storage_index.fqn, tensor))


def _file_of(tmp_path, *values) -> list[tuple[int, int]]:
    """A file of junk and ``torch.save`` archives, as a DCP file is; each archive's (offset, length)."""
    spans, data = [], bytearray(b"junk" * 10)
    for value in values:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        spans.append((len(data), len(buffer.getvalue())))
        data += buffer.getvalue() + b"more junk"
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    return spans


def test_the_items_of_one_load_are_read_by_one_set_of_threads(tmp_path, monkeypatch):
    saved = {f"w{n}": torch.full((64, 64), float(n)) for n in range(4)}
    dcp.save(saved, storage_writer=DirectWriter(tmp_path), no_dist=True)
    mine = {key: torch.zeros(64, 64) for key in saved}
    seen = _spy(monkeypatch)
    monkeypatch.setattr(archive_load, "IN_PLACE_FROM", 1)
    safe_load(mine, tmp_path, no_dist=True)
    assert all(torch.equal(mine[key], saved[key]) for key in saved)
    assert [placed for placed, _, _ in seen] == [True] * 4
    assert len({pool for _, _, pool in seen}) == 1 and seen[0][2] != 0


def test_an_item_larger_than_its_shard_gives_the_shard_its_corner(tmp_path, monkeypatch):
    monkeypatch.setattr(archive_load, "IN_PLACE_FROM", 1)
    ((offset, length),) = _file_of(tmp_path, torch.arange(30.0).reshape(6, 5))
    item, where = _item("__0_0.distcp", offset, length, lengths=[4, 3])
    target = torch.zeros(4, 3)
    planner = _Planner({item.storage_index.fqn: target})
    left = dcp_reads.read_in_place(
        tmp_path, {item.storage_index: where}, SimpleNamespace(items=[item]), planner
    )
    assert left == [] and [(n, t.data_ptr() == target.data_ptr()) for n, t in planner.committed] == [
        (item.storage_index.fqn, True)
    ]
    assert torch.equal(target, torch.arange(30.0).reshape(6, 5)[:4, :3])


def test_what_this_reader_does_not_take_is_left_to_dcp_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(archive_load, "IN_PLACE_FROM", 1)  # only the reasons below leave an item to DCP
    spans = _file_of(tmp_path, torch.ones(4), torch.ones(4), torch.ones(4), torch.ones(2, 2), torch.ones(4))
    items = [
        _item("__0_0.distcp", *spans[0], lengths=[4], offsets=[1]),  # a piece away from the origin
        _item("__0_0.distcp", *spans[1], lengths=[4], transform=["zstd"]),  # transformed when written
        _item("../__0_0.distcp", *spans[2], lengths=[4]),  # a file outside the folder
        _item("__0_0.distcp", *spans[3], lengths=[2, 2]),  # its shard is not contiguous
        _item("__0_0.distcp", *spans[4], lengths=[4], kind=LoadItemType.BYTE_IO),  # a value
    ]
    targets = {item.storage_index.fqn: torch.zeros(4) for item, _ in items}
    targets[items[3][0].storage_index.fqn] = torch.zeros(2, 2).t()
    planner = _Planner(targets)
    plan = SimpleNamespace(items=[item for item, _ in items])
    left = dcp_reads.read_in_place(
        tmp_path, {item.storage_index: where for item, where in items}, plan, planner
    )
    assert left == plan.items and planner.committed == []
    assert dcp_reads.read_in_place(tmp_path, None, plan, planner) == plan.items  # no description: all to DCP
    assert not any(t.any() for t in targets.values())
    assert sorted(os.listdir(tmp_path)) == ["__0_0.distcp"]


def test_a_folder_unison_wrote_loads_in_place_without_a_note_per_item(tmp_path, monkeypatch, caplog):
    """Its records carry no CRC-32s (each file's own covers them, checked before a load): reading
    its items in place says nothing about them, where a checkpoint file without any is noted."""
    import logging

    saved = {f"w{i}": torch.randn(20_000) for i in range(3)}
    dcp.save(saved, storage_writer=DirectWriter(tmp_path), no_dist=True)
    mine = {k: torch.zeros(20_000) for k in saved}
    seen = _spy(monkeypatch)
    monkeypatch.setattr(archive_load, "IN_PLACE_FROM", 1)
    with caplog.at_level(logging.INFO, logger="unison"):
        safe_load(mine, tmp_path, no_dist=True)
    assert all(torch.equal(mine[k], v) for k, v in saved.items())
    assert [placed for placed, _, _ in seen] == [True] * 3
    assert not [r for r in caplog.records if "no CRC-32s" in r.getMessage()]
