"""torch.save's per-record CRC-32s left out of a sharded checkpoint's tensors, in the saving thread
only, with every file's own CRC-32 still covering (and checked over) every byte."""

from __future__ import annotations

import io
import struct
import threading
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unison.checkpoint.dcp_files import DirectWriter
from unison.checkpoint.record_crcs import records_without_crcs

_CENTRAL_HEADER = b"PK\x01\x02"


def crcs_of(buffer: io.BytesIO) -> dict[str, int]:
    return {info.filename.split("/", 1)[1]: info.CRC for info in zipfile.ZipFile(buffer).infolist()}


def saved(value: torch.Tensor) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer


def test_torch_save_computes_each_records_crc_and_torch_load_never_checks_it():
    """The truth the module rests on, in this torch: the CRC-32s are there, and nothing reads them."""
    value = torch.arange(64.0)
    buffer = saved(value)
    assert crcs_of(buffer)["data/0"] == zlib.crc32(value.numpy().tobytes())
    raw = bytearray(buffer.getvalue())
    at = raw.index(value.numpy().tobytes())
    raw[at + 8] ^= 0xFF  # one byte of the tensor flipped, its record's CRC-32 left as it was
    loaded = torch.load(io.BytesIO(bytes(raw)))
    assert int((loaded != value).sum()) == 1
    with pytest.raises(zipfile.BadZipFile, match="CRC"):
        zipfile.ZipFile(io.BytesIO(bytes(raw))).read("archive/data/0")


def test_inside_the_records_have_no_crc_and_the_tensor_loads_equal():
    value = torch.randn(100)
    with records_without_crcs():
        buffer = saved(value)
    assert set(crcs_of(buffer).values()) == {0}
    assert torch.equal(torch.load(io.BytesIO(buffer.getvalue())), value)


def test_torchs_own_function_is_back_after_leaving_after_nesting_and_after_an_error():
    own = torch.serialization.get_crc32_options
    with records_without_crcs():
        assert torch.serialization.get_crc32_options is not own
        with records_without_crcs():
            pass
        assert not torch.serialization.get_crc32_options()  # the outer one still holds
    assert torch.serialization.get_crc32_options is own
    with pytest.raises(RuntimeError, match="inside"):
        with records_without_crcs():
            raise RuntimeError("inside")
    assert torch.serialization.get_crc32_options is own
    assert crcs_of(saved(torch.ones(3)))["data/0"] != 0


def test_another_threads_save_keeps_its_crcs_and_torchs_setting():
    """An asynchronous save's thread is inside while the training thread may torch.save."""
    own = torch.serialization.get_crc32_options
    inside, done = threading.Event(), threading.Event()
    mine: list[io.BytesIO] = []

    def writer() -> None:
        with records_without_crcs():
            mine.append(saved(torch.ones(8)))
            inside.set()
            done.wait(30)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert inside.wait(30)
        value = torch.arange(16.0)
        assert crcs_of(saved(value))["data/0"] == zlib.crc32(value.numpy().tobytes())
        assert torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)  # the user's own setting still decides here
        try:
            assert not torch.serialization.get_crc32_options()
            assert set(crcs_of(saved(value)).values()) == {0}
        finally:
            torch.serialization.set_crc32_options(True)
    finally:
        done.set()
        thread.join(30)
    assert set(crcs_of(mine[0]).values()) == {0}
    assert torch.serialization.get_crc32_options is own


def test_a_function_replaced_by_someone_else_meanwhile_is_left_in_place(monkeypatch):
    own = torch.serialization.get_crc32_options
    monkeypatch.setattr(torch.serialization, "get_crc32_options", own)  # torch's is put back after the test

    def theirs() -> bool:
        return True

    with records_without_crcs():
        torch.serialization.get_crc32_options = theirs
    assert torch.serialization.get_crc32_options is theirs


def record_crcs(data: bytes) -> list[int]:
    """The CRC-32 in every central directory entry of a DCP data file (one zip per tensor saved)."""
    found, at = [], data.find(_CENTRAL_HEADER)
    while at >= 0:
        found.append(struct.unpack_from("<I", data, at + 16)[0])
        at = data.find(_CENTRAL_HEADER, at + 4)
    return found


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_file_written_by_unison_has_no_record_crcs_and_its_own_crc_covers_every_byte(tmp_path: Path):
    states = {"model": {"w": torch.randn(300, 7), "b": torch.arange(5.0)}}
    writer = DirectWriter(tmp_path)
    dcp.save(states, storage_writer=writer, no_dist=True)
    (data,) = sorted(tmp_path.glob("*.distcp"))
    raw = data.read_bytes()
    crcs = record_crcs(raw)
    assert len(crcs) >= 2 * 5 and set(crcs) == {0}  # 2 tensors, 5 records each at least
    assert writer.checksums[data.name] == (len(raw), zlib.crc32(raw))
    assert torch.serialization.get_crc32_options()
    loaded = {"model": {"w": torch.zeros(300, 7), "b": torch.zeros(5)}}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(loaded["model"]["w"], states["model"]["w"])
    assert torch.equal(loaded["model"]["b"], states["model"]["b"])


def test_while_a_thread_is_inside_the_others_get_the_function_that_was_there(monkeypatch):
    """A wrapper of the user's, installed before, still answers every thread outside."""
    asked: list[str] = []

    def theirs() -> bool:
        asked.append(threading.current_thread().name)
        return False

    monkeypatch.setattr(torch.serialization, "get_crc32_options", theirs)
    inside, done = threading.Event(), threading.Event()

    def writer() -> None:
        with records_without_crcs():
            inside.set()
            done.wait(30)

    thread = threading.Thread(target=writer, name="saving")
    thread.start()
    try:
        assert inside.wait(30)
        assert set(crcs_of(saved(torch.ones(4))).values()) == {0}  # theirs said False
        assert asked == [threading.current_thread().name]
    finally:
        done.set()
        thread.join(30)
    assert torch.serialization.get_crc32_options is theirs
