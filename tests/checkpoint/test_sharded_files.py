"""A sharded checkpoint's file checksums: zlib's CRC-32 of the whole file, its blocks checksummed
by several threads at once."""

from __future__ import annotations

import random
import threading

import unison.checkpoint.crc as crc_module
from unison.checkpoint.sharded_files import file_checksum, remove


def test_a_files_checksum_is_its_crc32_from_blocks_checksummed_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setattr(crc_module, "READ", 1 << 12)
    data = random.Random(1).randbytes(50_001)
    (tmp_path / "__0_0.distcp").write_bytes(data)
    real = crc_module.crc32
    together = threading.Barrier(2, timeout=30)  # two blocks are checksummed at the same time, or this fails
    names: list[str] = []

    def spy(*args):
        names.append(threading.current_thread().name)
        if len(names) <= 2:
            together.wait()
        return real(*args)

    monkeypatch.setattr(crc_module, "crc32", spy)
    assert file_checksum(tmp_path / "__0_0.distcp") == (len(data), real(data))
    assert len(set(names)) >= 2
    (tmp_path / "empty").write_bytes(b"")
    assert file_checksum(tmp_path / "empty") == (0, 0)


def test_several_files_are_read_at_once_and_their_checksums_come_back_in_order(tmp_path, monkeypatch):
    import unison.checkpoint.sharded_files as files_module

    rng = random.Random(2)
    paths = []
    for i, size in enumerate([30_000, 0, 70_001, 5]):
        paths.append(tmp_path / f"__{i}_0.distcp")
        paths[-1].write_bytes(rng.randbytes(size))
    real = files_module.file_checksum
    together = threading.Barrier(2, timeout=30)  # two files are read at the same time, or this fails
    started: list[str] = []

    def spy(path):
        started.append(path.name)
        if len(started) <= 2:
            together.wait()
        return real(path)

    monkeypatch.setattr(files_module, "file_checksum", spy)
    assert files_module.files_checksums(paths) == [real(p) for p in paths]
    assert sorted(started) == sorted(p.name for p in paths)


def test_a_folder_made_while_a_stale_one_is_removed_goes_too(tmp_path, monkeypatch):
    """Rank 0 removes a temporary folder a dead save left while another rank's DCP makes it as it
    plans: the folder may appear between remove()'s look and its unlink."""
    from pathlib import Path

    target = tmp_path / ".ckpt-e0001-i000000003.dcp.tmp"
    real = Path.is_dir

    def is_dir_then_made(self):
        found = real(self)
        if self == target and not found:
            target.mkdir()  # another rank's mkdir, just after the look
        return found

    monkeypatch.setattr(Path, "is_dir", is_dir_then_made)
    remove(target)
    monkeypatch.undo()
    assert not target.exists()
    (tmp_path / "f.pt").write_bytes(b"x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    remove(tmp_path / "link")
    assert (tmp_path / "d" / "a").exists() and not (tmp_path / "link").exists(), "a link: the link alone"
    remove(tmp_path / "f.pt")
    remove(tmp_path / "d")
    assert not (tmp_path / "f.pt").exists() and not (tmp_path / "d").exists()
