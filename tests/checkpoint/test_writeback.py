"""Durable writes at the disk's speed: small pieces gathered, big ones passed through, and the
disk's writeback started every WRITEBACK bytes, before the fsync that waits for all of them."""

from __future__ import annotations

import os
import stat

import torch

import unison.checkpoint.direct as direct_module
import unison.checkpoint.io as io_module
import unison.checkpoint.writeback as writeback_module
from unison.checkpoint import atomic_save, load_checkpoint
from unison.checkpoint.writeback import SMALL, WritebackFile


class Raw:
    """An unbuffered file that writes at most ``most`` bytes a call, as ``os.write`` may."""

    def __init__(self, path, most: int) -> None:
        self.fh = open(path, "wb", buffering=0)  # noqa: SIM115
        self.most = most
        self.calls: list[int] = []

    def write(self, data) -> int:
        n = self.fh.write(data[: self.most])
        self.calls.append(n)
        return n

    def fileno(self) -> int:
        return self.fh.fileno()


def test_the_bytes_arrive_whole_and_in_order_small_pieces_gathered(tmp_path, monkeypatch):
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(
        writeback_module, "start_writeback", lambda fd, offset, n: started.append((offset, n))
    )
    raw = Raw(tmp_path / "f", most=300_000)
    sink = WritebackFile(raw, writeback=1 << 20)
    pieces = [os.urandom(n) for n in (10, 40, 2_000_000, 7, SMALL - 1, 3, 1_500_000, 1)]
    for piece in pieces:
        assert sink.write(piece) == len(piece)
    sink.write(memoryview(torch.arange(1000, dtype=torch.float32).numpy()))  # a non-byte buffer
    sink.flush()
    raw.fh.close()
    expected = b"".join(pieces) + torch.arange(1000, dtype=torch.float32).numpy().tobytes()
    assert (tmp_path / "f").read_bytes() == expected and sink.written == len(expected)
    assert len(raw.calls) < len(pieces) + 30  # the small pieces went out together, not one call each
    # writeback started back to back, from the first byte, every MiB or so, never past what was written
    assert started[0][0] == 0 and all(n >= 1 << 20 for _, n in started)
    assert all(a + n == b for (a, n), (b, _) in zip(started, started[1:], strict=False))
    assert started[-1][0] + started[-1][1] <= len(expected) < started[-1][0] + started[-1][1] + (2 << 20)


def test_without_o_direct_a_checkpoint_bigger_than_the_writeback_is_handed_to_the_disk_before_the_fsync(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(direct_module, "_O_DIRECT", None)  # a platform without O_DIRECT: the page cache
    events: list[str] = []
    real_fsync, real_start = os.fsync, writeback_module.start_writeback

    def fsync(fd):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def start(fd, offset, n):
        events.append("writeback")
        real_start(fd, offset, n)

    monkeypatch.setattr(io_module.os, "fsync", fsync)
    monkeypatch.setattr(writeback_module, "start_writeback", start)
    monkeypatch.setattr(writeback_module, "WRITEBACK", 1 << 20)
    state = {"w": torch.randn(1_000_000), "step": 3}  # 4 MB
    atomic_save(state, tmp_path / "c.pt")
    assert events[:3] == ["writeback"] * 3 and events[-2:] == ["fsync file", "fsync folder"]
    loaded = load_checkpoint(tmp_path / "c.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
