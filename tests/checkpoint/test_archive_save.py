"""A checkpoint file whose CRC-32s are computed while it is written: byte for byte what torch.save
writes with CRC-32s on, checked whole, damage caught; and torch.save where the fast path cannot go."""

from __future__ import annotations

import io
import threading
import zipfile
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unison.checkpoint.archive_save as archive_save
import unison.checkpoint.crc as crc_module
import unison.checkpoint.writeback as writeback_module
from unison.checkpoint import atomic_save, is_complete, load_checkpoint
from unison.checkpoint.archive_save import fast_path, save_archive
from unison.checkpoint.writeback import WritebackFile

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _saved(obj, path) -> tuple[bool, bytes]:
    with open(path, "wb", buffering=0) as fh:
        fast = save_archive(obj, WritebackFile(fh), threads=3)
    return fast, path.read_bytes()


@st.composite
def states(draw):
    """Many small tensors, empty ones, views sharing a storage, non-tensor leaves, nested."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    state: dict = {"step": draw(st.integers(0, 10**6)), "name": draw(st.text(max_size=8))}
    for n in range(draw(st.integers(0, 12))):
        shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        state[f"t{n}"] = (torch.rand(shape, generator=gen) * 100).to(dtype)
    base = torch.randn(draw(st.integers(1, 300)), generator=gen)
    state["views"] = [base[: draw(st.integers(0, len(base)))], base[draw(st.integers(0, len(base) - 1)) :]]
    state["nested"] = {
        "empty": torch.zeros(0),
        "none": None,
        "floats": [1.5, float("inf")],
        "bytes": b"\x00PK",
    }
    if draw(st.booleans()):  # a record big enough to be checksummed by threads, in several blocks
        state["big"] = torch.randn(draw(st.integers(300_000, 600_000)), generator=gen)
    return state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states())
def test_the_file_is_byte_for_byte_what_torch_save_writes_with_crc32s(tmp_path, monkeypatch, state):
    monkeypatch.setattr(crc_module, "BLOCK", 1 << 16)  # big records cut into many blocks
    monkeypatch.setattr(writeback_module, "PARALLEL", 1 << 17)
    fast, written = _saved(state, tmp_path / "a.pt")
    assert fast, "the fast path was not taken on this torch"
    assert written == _torch_bytes(state)


def test_a_large_record_and_a_storage_shared_by_two_tensors_come_out_identical(tmp_path):
    weights = torch.randn(5_000_000)  # 20 MB: three 8 MiB blocks, checksummed by threads
    state = {"w": weights, "alias": weights[10:20], "bias": torch.randn(4096)}
    fast, written = _saved(state, tmp_path / "a.pt")
    assert fast and written == _torch_bytes(state)


def test_atomic_save_checksums_big_records_in_other_threads_while_writing(tmp_path, monkeypatch):
    names: set[str] = set()
    real = crc_module.crc32

    def spy(*args):
        names.add(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(crc_module, "crc32", spy)
    state = {"w": torch.randn(3_000_000), "step": 7}
    path = atomic_save(state, tmp_path / "a.pt")
    assert any(n.startswith("unison-crc") for n in names), names
    monkeypatch.undo()
    assert path.read_bytes() == _torch_bytes(state)
    assert all(i.CRC for i in zipfile.ZipFile(path).infolist() if i.file_size)


def test_the_file_is_checked_whole_and_a_flipped_byte_is_caught(tmp_path):
    state = {"w": torch.randn(1_000_000), "b": torch.randn(10)}
    path = atomic_save(state, tmp_path / "a.pt")
    assert is_complete(path)
    assert torch.equal(load_checkpoint(path)["w"], state["w"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert not is_complete(path)


def test_the_pinned_torch_takes_the_fast_path():
    assert fast_path(), f"torch {torch.__version__}: its zip writer is not the one save_archive fills"


def test_a_user_who_turned_crc32s_off_gets_torch_save_without_them(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        fast, written = _saved({"w": torch.randn(100)}, tmp_path / "a.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert not fast
    assert all(i.CRC == 0 for i in zipfile.ZipFile(io.BytesIO(written)).infolist())


def test_a_replaced_torch_save_is_the_one_called(tmp_path, monkeypatch):
    calls: list[object] = []
    real = torch.save

    def wrapper(obj, fh, *args, **kwargs):
        calls.append(obj)
        real(obj, fh, *args, **kwargs)

    monkeypatch.setattr(torch, "save", wrapper)
    state = {"w": torch.randn(10)}
    fast, written = _saved(state, tmp_path / "a.pt")
    assert not fast and calls == [state]


@pytest.mark.parametrize("break_it", ["id", "central"])
def test_a_writer_that_does_not_write_as_expected_is_rewritten_by_torch_save(tmp_path, monkeypatch, break_it):
    if break_it == "id":  # the serialization id torch computed is not the one expected
        monkeypatch.setattr(archive_save, "hash_combine", lambda seed, value: seed + value + 1)
    else:  # a central directory whose names are not the records'
        monkeypatch.setattr(archive_save.CrcFiller, "_central", lambda self, view: self._lost(view))
    state = {"w": torch.randn(300_000), "e": torch.zeros(0)}
    fast, written = _saved(state, tmp_path / "a.pt")
    assert not fast and written == _torch_bytes(state)


class Fingerprint:
    """A file that keeps only a checksum and the length of what is written to it."""

    def __init__(self) -> None:
        self.adler, self.size = 1, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.adler, self.size = zlib.adler32(view, self.adler), self.size + len(view)
        return len(view)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return -1


@pytest.mark.slow
def test_a_record_over_4_gib_and_one_past_it_come_out_identical_zip64():
    big = torch.empty(4_400_000_000, dtype=torch.uint8)  # never written: the kernel's zero page, no memory
    state = {"small": torch.arange(10.0), "big": big, "after": torch.ones(1000)}
    expected = Fingerprint()
    torch.save(state, expected)
    written = Fingerprint()
    sink = WritebackFile(written, writeback=0)
    assert save_archive(state, sink)
    sink.flush()
    assert (written.adler, written.size) == (expected.adler, expected.size)


def test_a_torch_whose_private_writer_api_changed_gets_torch_save(tmp_path, monkeypatch):
    real = torch.serialization._save

    def changed(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record, extra=None):
        return real(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)

    monkeypatch.setattr(torch.serialization, "_save", changed)
    state = {"w": torch.randn(100)}
    fast, written = _saved(state, tmp_path / "a.pt")
    monkeypatch.undo()
    assert not fast and written == _torch_bytes(state)
