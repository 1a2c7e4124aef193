"""CRC-32s of a file's ranges, read and computed in blocks by several threads, combined exactly."""

from __future__ import annotations

import os
import random
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

import unison.checkpoint.crc as crc_module
from unison.checkpoint.crc import blocks, range_crcs, shift


@pytest.mark.parametrize(
    "first, second", [(0, 5), (7, 0), (1, 1), (1000, 4096), (3, 1 << 20), (1 << 16, 12345)]
)
def test_a_shifted_crc_combines_with_the_next_bytes_crc_as_zlib_computes_the_whole(first, second):
    rng = random.Random(first * 31 + second)
    a, b = rng.randbytes(first), rng.randbytes(second)
    assert shift(zlib.crc32(a), len(b)) ^ zlib.crc32(b) == zlib.crc32(a + b)


def test_a_range_is_cut_into_a_short_first_block_then_whole_blocks(monkeypatch):
    monkeypatch.setattr(crc_module, "BLOCK", 10)
    assert list(blocks(100, 35)) == [(100, 5), (105, 10), (115, 10), (125, 10)]
    assert list(blocks(0, 20)) == [(0, 10), (10, 10)]
    assert list(blocks(3, 0)) == []


def test_each_range_gets_its_crc_from_blocks_checksummed_by_several_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(crc_module, "READ", 4096)
    data = random.Random(0).randbytes(200_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = [(0, 0), (10, 3), (17, 4096), (5000, 150_000), (199_990, 10), (199_000, 2000)]  # the last: cut
    names: set[str] = set()
    real = crc_module.crc32
    together = threading.Barrier(2, timeout=30)  # the first two blocks are checksummed at the same time
    calls: list[int] = []

    def spy(*args):
        names.add(threading.current_thread().name)
        calls.append(1)
        if len(calls) <= 2:
            together.wait()
        return real(*args)

    monkeypatch.setattr(crc_module, "crc32", spy)
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = range_crcs(fd, ranges, threads=4)
    finally:
        os.close(fd)
    assert crcs[:-1] == [real(data[o : o + n]) for o, n in ranges[:-1]]
    assert crcs[-1] is None, "a range the file ends inside has no CRC"
    assert len(names) >= 2 and all(n.startswith("unison-crc") for n in names), names


def test_a_buffer_is_checksummed_by_other_threads_while_the_caller_writes_it(monkeypatch):
    monkeypatch.setattr(crc_module, "BLOCK", 4096)
    data = memoryview(random.Random(1).randbytes(50_000))  # a short first block, then 12 whole ones
    real = crc_module.crc32
    checksummed = threading.Event()
    names: set[str] = set()

    def spy(*args):
        names.add(threading.current_thread().name)
        checksummed.set()
        return real(*args)

    def write(view: memoryview) -> None:  # the caller's work: it sees a block checksummed meanwhile
        assert checksummed.wait(30), "no block was checksummed while the buffer was written"

    monkeypatch.setattr(crc_module, "crc32", spy)
    with ThreadPoolExecutor(3, thread_name_prefix="unison-crc") as pool:
        assert crc_module.crc_while(data, write, pool) == real(data)
    assert names and all(n.startswith("unison-crc") for n in names), names


def test_every_block_is_checksummed_before_a_failed_write_returns(monkeypatch):
    """The buffer may be a temporary freed once the write returns: no thread may read it after."""
    monkeypatch.setattr(crc_module, "BLOCK", 4096)
    release = threading.Event()
    done: list[int] = []
    real = crc_module.crc32

    def slow(view):
        release.wait(30)
        done.append(1)
        return real(view)

    def fail(view: memoryview) -> None:
        release.set()
        raise OSError("disk full")

    monkeypatch.setattr(crc_module, "crc32", slow)
    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError, match="disk full"):
        try:
            crc_module.crc_while(memoryview(bytes(40_000)), fail, pool)
        finally:
            assert len(done) == 10, "a block was still being checksummed when the write returned"


def test_a_range_is_read_in_file_order_by_the_calling_thread_while_others_checksum(tmp_path, monkeypatch):
    """One thread reading a file in order ran faster here than threads reading blocks at once."""
    monkeypatch.setattr(crc_module, "READ", 4096)
    data = random.Random(2).randbytes(50_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    reads: list[tuple[int, int, bool]] = []
    summed: list[bool] = []
    real_read, real_crc = os.preadv, crc_module.crc32

    def reading(fd, buffers, offset):
        n = real_read(fd, buffers, offset)
        reads.append((offset, n, threading.current_thread() is threading.main_thread()))
        return n

    def summing(*args):
        summed.append(threading.current_thread() is threading.main_thread())
        return real_crc(*args)

    monkeypatch.setattr(os, "preadv", reading)
    monkeypatch.setattr(crc_module, "crc32", summing)
    fd = os.open(path, os.O_RDONLY)
    try:
        crcs = range_crcs(fd, [(100, 20_000), (30_000, 20_000)], threads=3)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert crcs == [zlib.crc32(data[100:20_100]), zlib.crc32(data[30_000:50_000])]
    offsets = [at for at, _, _ in reads]
    assert offsets == sorted(offsets) and all(main for *_, main in reads), "not in order by the caller"
    assert all(n <= 4096 for _, n, _ in reads) and sum(n for _, n, _ in reads) == 40_000, (
        "each byte read once"
    )
    assert summed and not any(summed), "a block was checksummed by the reading thread"
