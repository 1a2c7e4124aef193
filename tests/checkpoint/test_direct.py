"""Checkpoint files written with O_DIRECT from staging buffers: every byte lands where it belongs,
every full buffer goes around the page cache, only the tail goes through it, a file system that
refuses O_DIRECT gets the page cache instead, and a failed write is raised, not lost."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import zlib

import pytest
import torch
from _direct_io import direct_folder  # noqa: F401 - the fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unison.checkpoint.direct as direct_module
import unison.checkpoint.io as io_module
from unison.checkpoint import atomic_save, load_checkpoint
from unison.checkpoint.direct import DirectFile

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")

CHUNK = 8192


class Recorder:
    """Records each ``_pwrite_all``: (which descriptor, offset, bytes)."""

    def __init__(self, monkeypatch, fail=None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail = fail
        real = direct_module._pwrite_all

        def record(fd, view, offset):
            self.calls.append((fd, offset, len(view)))
            if self.fail is not None:
                self.fail(fd, view, offset)
            real(fd, view, offset)

        monkeypatch.setattr(direct_module, "_pwrite_all", record)


def _write(path, pieces, *, flush_at=(), depth=2, chunk=CHUNK, checksum=False):
    with (
        open(path, "wb", buffering=0) as raw,
        DirectFile(raw, path, chunk=chunk, depth=depth, checksum=checksum) as sink,
    ):
        for n, piece in enumerate(pieces):
            assert sink.write(piece) == len(piece)
            if n in flush_at:
                sink.flush()
        sink.flush()
        sink.crc_at_end = sink.crc if checksum else None
        return sink, raw.fileno()


@pytest.mark.usefixtures("direct_folder")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 3 * CHUNK + 5), max_size=12),
    flush_at=st.sets(st.integers(0, 11), max_size=3),
    depth=st.integers(1, 3),
)
def test_the_file_holds_every_byte_in_order_and_every_full_buffer_went_around_the_page_cache(
    tmp_path, monkeypatch, sizes, flush_at, depth
):
    with monkeypatch.context() as patch:
        recorder = Recorder(patch)
        path = tmp_path / "f.bin"
        pieces = [os.urandom(n) for n in sizes]
        sink, raw_fd = _write(path, pieces, flush_at=flush_at, depth=depth, checksum=True)
    expected = b"".join(pieces)
    assert path.read_bytes() == expected
    assert sink.crc_at_end == zlib.crc32(expected)  # full buffers checksummed by the writer threads
    assert sink.written == len(expected)
    direct = sorted((offset, n) for fd, offset, n in recorder.calls if fd != raw_fd)
    full = len(expected) // CHUNK
    assert direct == [(i * CHUNK, CHUNK) for i in range(full)]  # each full buffer once, with O_DIRECT
    through_cache = [(offset, n) for fd, offset, n in recorder.calls if fd == raw_fd]
    assert all(n < CHUNK for _, n in through_cache)  # only partial buffers: the tail, and a mid-way flush's


@pytest.mark.usefixtures("direct_folder")
def test_the_direct_descriptor_is_opened_with_o_direct_and_closed(tmp_path, monkeypatch):
    flags: list[int] = []
    real = direct_module._pwrite_all

    def record(fd, view, offset):
        flags.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        real(fd, view, offset)

    monkeypatch.setattr(direct_module, "_pwrite_all", record)
    path = tmp_path / "f.bin"
    payload = os.urandom(3 * CHUNK + 100)
    sink, _ = _write(path, [payload])
    assert [bool(f & os.O_DIRECT) for f in flags] == [True, True, True, False]
    assert sink._fd is None and path.read_bytes() == payload


def test_a_file_system_that_refuses_o_direct_at_open_gets_the_page_cache_with_its_writeback_started(
    tmp_path, monkeypatch
):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    started: list[tuple[int, int]] = []
    monkeypatch.setattr(direct_module.os, "open", refusing_open)
    monkeypatch.setattr(direct_module, "start_writeback", lambda fd, offset, n: started.append((offset, n)))
    path = tmp_path / "f.bin"
    payload = os.urandom(4 * CHUNK + 17)
    sink, _ = _write(path, [payload])
    assert path.read_bytes() == payload and not sink.direct
    assert sorted(started) == [(i * CHUNK, CHUNK) for i in range(4)]


def test_a_file_system_that_refuses_an_o_direct_write_gets_that_buffer_and_the_rest_through_the_page_cache(
    tmp_path, monkeypatch
):
    def fail(fd, view, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")

    recorder = Recorder(monkeypatch, fail)
    path = tmp_path / "f.bin"
    payload = os.urandom(5 * CHUNK + 3)
    sink, raw_fd = _write(path, [payload], depth=1)
    assert path.read_bytes() == payload and not sink.direct
    assert sum(n for fd, _, n in recorder.calls if fd == raw_fd) == len(payload)


def test_a_full_disk_in_a_writer_thread_is_raised_to_the_caller_and_nothing_is_left_running(
    tmp_path, monkeypatch
):
    def fail(fd, view, offset):
        if offset >= 2 * CHUNK:
            raise OSError(errno.ENOSPC, "No space left on device")

    Recorder(monkeypatch, fail)
    path = tmp_path / "f.bin"
    with open(path, "wb", buffering=0) as raw:
        sink = DirectFile(raw, path, chunk=CHUNK, depth=2)
        with pytest.raises(OSError) as caught:
            try:
                for _ in range(8):
                    sink.write(os.urandom(CHUNK))
                sink.flush()
            finally:
                sink.close()
    assert caught.value.errno == errno.ENOSPC
    assert sink._writers is None and sink._fd is None and not sink._inflight


def test_restart_empties_the_file_to_write_it_again(tmp_path):
    path = tmp_path / "f.bin"
    again = os.urandom(CHUNK + 9)
    with open(path, "wb", buffering=0) as raw, DirectFile(raw, path, chunk=CHUNK) as sink:
        sink.write(os.urandom(3 * CHUNK + 1))
        sink.restart()
        sink.write(again)
        sink.flush()
    assert path.read_bytes() == again and sink.written == len(again)


def test_a_chunk_that_is_not_whole_pages_is_refused(tmp_path):
    with open(tmp_path / "f.bin", "wb", buffering=0) as raw, pytest.raises(ValueError, match="chunk=1000"):
        DirectFile(raw, tmp_path / "f.bin", chunk=1000)


@pytest.mark.usefixtures("direct_folder")
def test_a_checkpoint_goes_to_the_disk_around_the_page_cache_before_its_fsync(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_pwrite_all = os.fsync, direct_module._pwrite_all

    def fsync(fd):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def pwrite_all(fd, view, offset):
        events.append("direct" if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT else "page cache")
        real_pwrite_all(fd, view, offset)

    monkeypatch.setattr(io_module.os, "fsync", fsync)
    monkeypatch.setattr(direct_module, "_pwrite_all", pwrite_all)
    monkeypatch.setattr(direct_module, "DIRECT_FROM", 2 * direct_module.CHUNK)
    state = {"w": torch.randn(9 * direct_module.CHUNK // 16), "step": 3}  # two full buffers and a tail
    atomic_save(state, tmp_path / "c.pt")
    full = (tmp_path / "c.pt").stat().st_size // direct_module.CHUNK
    assert full == 2
    assert events == ["direct"] * full + ["page cache", "fsync file", "fsync folder"]
    loaded = load_checkpoint(tmp_path / "c.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert not list(tmp_path.glob("*.tmp"))


def test_a_file_opened_without_checksum_has_no_crc_to_give(tmp_path):
    sink, _ = _write(tmp_path / "f.bin", [b"x" * 10])
    with pytest.raises(ValueError, match="checksum=True"):
        _ = sink.crc


@pytest.mark.parametrize("numel", [1_000_000, 3_000_000], ids=["below", "above"])
def test_a_state_below_direct_from_goes_through_the_page_cache_and_one_above_around_it(
    tmp_path, monkeypatch, numel
):
    monkeypatch.setattr(direct_module, "DIRECT_FROM", 8 << 20)  # 4 MB below it, 12 MB above
    sinks: list[str] = []
    real_open_sink = io_module.open_sink

    def open_sink(raw, path, size=0, direct=None):
        sink = real_open_sink(raw, path, size, direct)
        sinks.append(type(sink).__name__)
        return sink

    monkeypatch.setattr(io_module, "open_sink", open_sink)
    state = {"w": torch.randn(numel), "same": None}
    state["same"] = state["w"][:10]  # a view of the same storage counts once
    atomic_save(state, tmp_path / "c.pt")
    assert sinks == (["WritebackFile"] if numel * 4 < 8 << 20 else ["DirectFile"])
    assert torch.equal(load_checkpoint(tmp_path / "c.pt")["w"], state["w"])


def test_a_link_put_in_the_files_place_is_not_followed_every_byte_goes_to_the_file_opened(tmp_path):
    path, elsewhere = tmp_path / "f.bin", tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"untouched")
    payload = os.urandom(3 * CHUNK + 7)
    with open(path, "w+b", buffering=0) as raw, DirectFile(raw, path, chunk=CHUNK) as sink:
        sink.write(payload[:10])
        path.unlink()
        path.symlink_to(elsewhere)  # before the first full buffer opens the name again
        sink.write(payload[10:])
        sink.flush()
        written = os.pread(raw.fileno(), len(payload) + 1, 0)
    assert elsewhere.read_bytes() == b"untouched"
    assert written == payload and not sink.direct
