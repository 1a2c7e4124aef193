"""A sharded checkpoint's DCP files go to the disk with O_DIRECT, DCP's flush after each tensor
writes nothing, and each file's size and CRC-32 are kept as it is written: the same as read back."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _direct_io import direct_folder  # noqa: F401 - the fixture
from _sharded_folders import results_only

import unison.checkpoint.direct as direct_module
from unison.checkpoint.dcp_files import DirectWriter
from unison.checkpoint.sharded_files import file_checksum

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


@pytest.mark.usefixtures("direct_folder")
def test_dcp_files_are_written_around_the_page_cache_and_checksummed_as_they_are_written(
    tmp_path, monkeypatch
):
    writes: list[tuple[str, bool]] = []
    real = direct_module._pwrite_all

    def record(fd, view, offset):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        writes.append((name, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        real(fd, view, offset)

    monkeypatch.setattr(direct_module, "_pwrite_all", record)
    gen = torch.Generator().manual_seed(0)
    # ten tensors of a quarter buffer each, in one file: two full staging buffers and a tail
    state = {f"w{i}": torch.randn(direct_module.CHUNK // 16, generator=gen) for i in range(10)}
    state["step"] = torch.tensor(7)
    writer = DirectWriter(tmp_path)
    dcp.save(state, storage_writer=writer, no_dist=True)

    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    assert shards == ["__0_0.distcp"]
    size = (tmp_path / shards[0]).stat().st_size
    full = size // direct_module.CHUNK
    assert full == 2
    mine = [direct for name, direct in writes if name == shards[0]]
    # two full buffers with O_DIRECT, then the tail once: the flushes after each of 11 tensors wrote nothing
    assert mine == [True] * full + [False]

    (kept,) = writer.gathered().files  # one rank: its files and the metadata, none of them read back
    assert kept == {name: file_checksum(tmp_path / name) for name in [*shards, ".metadata"]}
    assert writer.checksums[shards[0]][0] == size

    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.usefixtures("direct_folder")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_small_writes_reach_the_file_gathered_and_every_item_where_its_record_says(tmp_path, monkeypatch):
    """``torch.save`` writes each tensor's archive in dozens of small calls; they reach the
    ``DirectFile`` gathered in blocks of about 4 KiB, and every item still lies at the offset and
    length DCP recorded for it (its ``tell()`` counts what is gathered): each reads back alone."""
    from unison.checkpoint.dcp_small import decode

    calls = []
    real = direct_module.DirectFile.write

    def counted(self, data):
        calls.append(len(memoryview(data)))
        return real(self, data)

    monkeypatch.setattr(direct_module.DirectFile, "write", counted)
    gen = torch.Generator().manual_seed(0)
    state = {
        f"layer{i}.{kind}": torch.randn(8, 8 if kind == "weight" else 1, generator=gen)
        for i in range(24)
        for kind in ("weight", "bias")
    }
    state["big"] = torch.randn(2048 + 3, generator=gen)  # a record past SMALL, between small ones
    writer = DirectWriter(tmp_path)
    dcp.save(state, storage_writer=writer, no_dist=True)

    (shard,) = sorted(n for n in os.listdir(tmp_path) if n.endswith(".distcp"))
    size = (tmp_path / shard).stat().st_size
    written = size + (tmp_path / ".metadata").stat().st_size  # the metadata goes through a DirectFile too
    assert sum(calls) == written and writer.checksums[shard] == file_checksum(tmp_path / shard)
    small = [n for n in calls if n < 4096]
    assert len(calls) < 2 * len(state) + size // 4096  # 39 a tensor before
    assert len(small) <= 2 * len(state)  # each a remainder before a big write, or the file's last

    from unison.checkpoint.sharded_check import read_metadata

    metadata = read_metadata(tmp_path)
    data = (tmp_path / shard).read_bytes()
    for index, where in metadata.storage_data.items():
        assert where.relative_path == shard
        got = decode(data[where.offset : where.offset + where.length])
        assert got is not None and torch.equal(got, state[index.fqn]), index.fqn


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_where_no_checksums_came_the_folder_is_read_back_and_every_file_recorded(tmp_path, monkeypatch):
    """The files of a rank whose checksums did not reach rank 0 are read back: ``checksums.json``
    still lists every file with its size and CRC-32. ``unison doctor`` names such a torch."""
    import json

    from unison.checkpoint.dcp_files import DirectWriter as Writer
    from unison.checkpoint.sharded import finish_folder, temp_folder, write_shards
    from unison.cli import private_apis

    monkeypatch.setattr(Writer, "write_data", results_only)
    final = tmp_path / "ckpt-e0001-i000000001.dcp"
    tmp = temp_folder(final)
    written = write_shards({"w": torch.randn(50), "step": torch.tensor(3)}, tmp).files
    assert written == [{".metadata": file_checksum(tmp / ".metadata")}]  # nothing came of the data file
    finish_folder(tmp, final, {"meta": {}}, {n: v for mine in written for n, v in mine.items()})
    sums = json.loads((final / "checksums.json").read_text())["files"]
    files = sorted(p.name for p in final.iterdir() if p.name != "checksums.json")
    assert sorted(sums) == files and "__0_0.distcp" in files
    assert all(file_checksum(final / n) == (e["size"], e["crc32"]) for n, e in sums.items())
    assert "as write_data returned them" in private_apis._rank_files()
