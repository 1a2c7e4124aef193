"""A checkpoint file loaded in one read: the bytes checked are the bytes loaded, every record's CRC-32
checked before any tensor is handed out."""

from __future__ import annotations

import io
import os
import threading
import zipfile

import pytest
import torch

import unison.checkpoint.crc as crc_module
from unison.checkpoint import CheckpointError, Manifest, atomic_save, load_checkpoint
from unison.checkpoint.archive import _kept, file_whole, keep_checked
from unison.checkpoint.archive_load import Damaged, read_archive


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(700_000, generator=gen),
        "b": torch.randn(7, generator=gen),
        "e": torch.zeros(0),
        "n": 3,
    }


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def _data_start(path, name: str) -> int:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(name))
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        lengths = fh.read(4)
    return (
        info.header_offset
        + 30
        + int.from_bytes(lengths[:2], "little")
        + int.from_bytes(lengths[2:], "little")
    )


def test_bytes_damaged_after_any_check_are_caught_by_the_load_itself(tmp_path, monkeypatch):
    """The bytes checked are the bytes loaded: a file changed between a check and the read is caught."""
    path = atomic_save(_state(), tmp_path / "a.pt")
    offset = _data_start(path, "data/0") + 1000
    real = torch.load

    def damaging_load(*args, **kwargs):
        _flip(path, offset)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", damaging_load)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


@pytest.mark.parametrize("record", ["data.pkl", "data/0", "data/1", "version", ".data/serialization_id"])
def test_a_flipped_byte_in_any_record_is_caught_before_a_state_is_returned(tmp_path, record):
    path = atomic_save(_state(), tmp_path / "a.pt")
    _flip(path, _data_start(path, record))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_a_large_record_is_read_in_blocks_and_checksummed_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(crc_module, "BLOCK", 1 << 16)  # 2.8 MB of weights: 43 blocks, a short first one
    state = _state()
    path = atomic_save(state, tmp_path / "a.pt")
    loaded = read_archive(path, threads=3)
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3 and loaded["e"].numel() == 0


def test_a_file_cut_short_is_damaged(tmp_path):
    path = atomic_save(_state(), tmp_path / "a.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(Damaged):
        read_archive(path)


def test_a_checked_file_is_read_without_checksumming_it_again(tmp_path, monkeypatch):
    path = atomic_save(_state(), tmp_path / "a.pt")
    calls: list[int] = []
    real = crc_module.crc32
    monkeypatch.setattr(crc_module, "crc32", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(load_checkpoint(path, checked=True)["w"], _state()["w"])
    assert calls == []


def test_it_loads_what_torch_load_loads(tmp_path):
    buffer = io.BytesIO()
    state = {"x": torch.arange(12).reshape(3, 4)[:, 1:], "shared": [torch.ones(3)] * 2}
    torch.save(state, buffer)
    path = tmp_path / "a.pt"
    path.write_bytes(buffer.getvalue())
    loaded = read_archive(path)
    assert torch.equal(loaded["x"], state["x"]) and loaded["shared"][0] is loaded["shared"][1]
    assert os.path.getsize(path) == len(buffer.getvalue())


class ReadCount:
    """Counts the bytes read by ``os.preadv`` (every read of a checkpoint's check and load)."""

    def __init__(self, monkeypatch) -> None:
        self.bytes = 0
        real = os.preadv

        def counting(fd, buffers, offset):
            n = real(fd, buffers, offset)
            self.bytes += n
            return n

        monkeypatch.setattr(os, "preadv", counting)


def test_the_check_of_the_newest_checkpoint_and_its_load_read_it_once(tmp_path, monkeypatch):
    atomic_save({"meta": {}, "w": torch.zeros(10)}, tmp_path / "ckpt-e0001-i000000001.pt")
    newest = atomic_save({"meta": {}, **_state()}, tmp_path / "ckpt-e0002-i000000002.pt")
    manifest = Manifest(tmp_path).rebuild()  # it finds both files (and reads them) before the count
    reads = ReadCount(monkeypatch)
    with keep_checked():
        assert manifest.newest_complete() == newest
        state = load_checkpoint(newest, checked=True)
    assert torch.equal(state["w"], _state()["w"])
    assert reads.bytes < 1.1 * newest.stat().st_size, (
        f"read {reads.bytes} bytes of a {newest.stat().st_size}-byte file"
    )


def test_outside_keep_checked_nothing_is_kept(tmp_path):
    path = atomic_save(_state(), tmp_path / "a.pt")
    assert file_whole(path) and _kept.stack == []
    with keep_checked():
        assert file_whole(path) and len(_kept.stack) == 1 and len(_kept.stack[0].states) == 1
    assert _kept.stack == []


def test_a_damaged_newest_checkpoint_is_passed_over_while_keeping(tmp_path):
    older = atomic_save({"meta": {}, "w": torch.ones(10)}, tmp_path / "ckpt-e0001-i000000001.pt")
    newest = atomic_save({"meta": {}, **_state()}, tmp_path / "ckpt-e0002-i000000002.pt")
    _flip(newest, _data_start(newest, "data/0") + 10)
    manifest = Manifest(tmp_path).rebuild()  # it finds both files (and reads them) before the count
    with keep_checked():
        assert manifest.newest_complete() == older
        assert torch.equal(load_checkpoint(older, checked=True)["w"], torch.ones(10))


def test_what_one_thread_keeps_is_its_own(tmp_path):
    path = atomic_save(_state(), tmp_path / "a.pt")
    seen: list[int] = []

    def other() -> None:
        assert file_whole(path)
        seen.append(len(_kept.stack))

    with keep_checked():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(30)
        assert seen == [0] and [f.states for f in _kept.stack] == [{}], (
            "the other thread's check kept a state here"
        )
