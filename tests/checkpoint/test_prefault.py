"""New memory is faulted in by another thread ahead of the reads that fill it: counted page faults,
the order of fault-ins and reads, and the fallback where the kernel refuses."""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unison.checkpoint.archive_reader as archive_reader
import unison.checkpoint.prefault as prefault
from unison.checkpoint import atomic_save
from unison.checkpoint.archive_load import read_archive
from unison.checkpoint.crc import BLOCK, blocks

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def _faults_writing_every_page(buffer: mmap.mmap) -> int:
    view = memoryview(buffer)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for at in range(0, len(buffer), 4096):
        view[at] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@linux
def test_a_populated_buffer_takes_no_page_faults_when_written_and_a_fresh_one_takes_one_a_page():
    pages = (8 << 20) // 4096
    fresh, populated = mmap.mmap(-1, 8 << 20), mmap.mmap(-1, 8 << 20)
    for buffer in (fresh, populated):  # 4 KiB pages, one fault each, even where huge pages are the default
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            buffer.madvise(mmap.MADV_NOHUGEPAGE)
    if not prefault.populate(prefault.address(memoryview(populated)), len(populated)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    assert _faults_writing_every_page(populated) < pages // 100
    assert _faults_writing_every_page(fresh) >= pages * 9 // 10


@linux
def test_populating_keeps_what_the_memory_holds():
    buffer = mmap.mmap(-1, 3 << 20)
    buffer[:5] = b"kept!"
    buffer[(2 << 20) + 7 : (2 << 20) + 12] = b"also!"
    prefault.populate(prefault.address(memoryview(buffer)), len(buffer))
    assert buffer[:5] == b"kept!" and buffer[(2 << 20) + 7 : (2 << 20) + 12] == b"also!"
    assert buffer[4096:8192] == bytes(4096)


def test_only_whole_pages_inside_the_range_are_populated(monkeypatch):
    calls = []
    monkeypatch.setattr(prefault, "_works", True)
    monkeypatch.setattr(
        prefault, "_madvise", lambda start, length, advice: calls.append((start, length)) or 0
    )
    assert prefault.populate(4096 * 10 + 64, 4096 * 3) is True
    assert calls == [(4096 * 11, 4096 * 2)]  # the partial pages at both ends are the neighbours'
    assert prefault.populate(4096 * 10 + 64, 100) is False  # no whole page: nothing asked
    assert len(calls) == 1


def test_a_kernel_without_populate_write_is_asked_once_then_never_again(monkeypatch):
    calls = []

    def refused(start, length, advice):
        calls.append(advice)
        ctypes.set_errno(22)  # EINVAL: the advice is unknown to this kernel
        return -1

    monkeypatch.setattr(prefault, "_works", True)
    monkeypatch.setattr(prefault, "_madvise", refused)
    assert prefault.populate(0, 1 << 20) is False
    assert prefault.populate(0, 1 << 20) is False
    assert calls == [23]


@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 9), reads=st.lists(st.integers(0, 8), max_size=12))
def test_every_block_is_faulted_in_before_it_is_read_and_none_after_close(count, reads):
    """Drawn block counts and read orders: block n's fault-in (n > 0) has finished when before(n) returns,
    at most AHEAD blocks past the one read were asked for, and close() leaves nothing in flight."""
    spans = [(i * 4096, 4096) for i in range(count)]
    done: list[int] = []
    running = threading.Lock()

    def fake(address, length):
        with running:
            done.append(address)
        return True

    buffer = bytearray(count * 4096)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefault, "_works", True)
        mp.setattr(prefault, "populate", fake)
        base = prefault.address(memoryview(buffer))
        with ThreadPoolExecutor(1) as pool:
            ahead = prefault.FaultAhead(memoryview(buffer), spans, pool)
            for n in sorted({r for r in reads if r < count}):
                ahead.before(n)
                assert n == 0 or base + n * 4096 in done  # block 0 is faulted in by its read
                assert ahead._next <= min(count, n + 1 + prefault.AHEAD)  # never further ahead
            ahead.close()
            asked = ahead._next
            assert not ahead._futures
    assert sorted(done) == done == [base + i * 4096 for i in range(1, asked)]


def _big_state() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {
        "big": torch.randn((3 * BLOCK + 12_345) // 4, generator=gen),
        "small": torch.randn(1000, generator=gen),
    }


def test_a_big_record_is_faulted_in_block_by_block_by_the_faulter_small_ones_are_not(tmp_path, monkeypatch):
    state = _big_state()
    path = atomic_save(state, tmp_path / "a.pt")
    threads: list[str] = []
    sizes: list[int] = []

    def counted(address, length):
        threads.append(threading.current_thread().name)
        sizes.append(length)
        return True

    monkeypatch.setattr(archive_reader, "FROM", 1 << 20)
    monkeypatch.setattr(prefault, "_works", True)
    monkeypatch.setattr(prefault, "populate", counted)
    loaded = read_archive(path)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])
    big = state["big"].numel() * 4
    assert (
        sizes == [length for _, length in blocks(0, big)][1:]
    )  # the big record's blocks after the first, in order
    assert set(threads) == {"unison-fault_0"}


@linux
def test_a_load_with_the_kernels_fault_ins_equals_torch_load(tmp_path):
    state = _big_state()
    path = atomic_save(state, tmp_path / "a.pt")
    loaded = read_archive(path)
    expected = torch.load(path, weights_only=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_where_the_kernel_refuses_the_load_is_the_same(tmp_path, monkeypatch):
    state = _big_state()
    path = atomic_save(state, tmp_path / "a.pt")
    monkeypatch.setattr(prefault, "_works", False)
    loaded = read_archive(path)
    assert torch.equal(loaded["big"], state["big"])
