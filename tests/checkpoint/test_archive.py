"""A checkpoint file's CRC-32s are checked in one pass over its bytes, every record's (a flipped
byte anywhere, the pickle included, is caught), and a resume reads the file once to check it
and once to load it: not a second time to check it again."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from unison.checkpoint import atomic_save, is_complete, load_checkpoint
from unison.checkpoint.io import CheckpointError
from unison.engine import Engine
from unison.handlers import Checkpoint


def _records(path: Path) -> dict[str, tuple[int, int]]:
    """Each record of a zip archive: its data's offset in the file and its size."""
    out = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            raw.seek(info.header_offset + 26)
            name_length, extra_length = (
                int.from_bytes(raw.read(2), "little"),
                int.from_bytes(raw.read(2), "little"),
            )
            out[info.filename] = (info.header_offset + 30 + name_length + extra_length, info.file_size)
    return out


@pytest.mark.parametrize("record", ["data.pkl", "data/0", "data/1", "byteorder"])
def test_a_flipped_byte_in_any_record_is_caught(tmp_path, record):
    state = {"w": torch.randn(300_000), "b": torch.arange(5), "name": "x"}
    path = atomic_save(state, tmp_path / "c.pt")
    offset, size = next(v for k, v in _records(path).items() if k.endswith("/" + record))
    data = bytearray(path.read_bytes())
    data[offset + size - 1] ^= 0x01
    path.write_bytes(bytes(data))
    assert not is_complete(path)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_a_file_cut_anywhere_is_caught(tmp_path):
    path = atomic_save({"w": torch.randn(100_000)}, tmp_path / "c.pt")
    whole = path.read_bytes()
    for cut in (1, 100, len(whole) // 2, len(whole) - 30, len(whole) - 1):
        path.write_bytes(whole[:cut])
        assert not is_complete(path), cut
    path.write_bytes(whole)
    assert is_complete(path)


def _bytes_read() -> int:
    """Bytes this process has read through read system calls, page cache hits included."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc/self/io (Linux)")
def test_a_resume_reads_the_checkpoint_once_to_check_and_load_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(1000, 2000)  # 8 MB: reads of anything else are small beside it
    engine = Engine(lambda engine, batch: None, sync_every=None)
    checkpoint = Checkpoint(tmp_path, {"model": model}, engine, every_epochs=1, keep_last=1)
    checkpoint.attach()
    engine.run(range(1), max_epochs=1)
    path = checkpoint.saved[-1]
    size = path.stat().st_size

    fresh = nn.Linear(1000, 2000)
    engine = Engine(lambda engine, batch: None, sync_every=None)
    resumed = Checkpoint(tmp_path, {"model": fresh}, engine, every_epochs=1, keep_last=1)
    before = _bytes_read()
    assert resumed.resume("auto") == path
    read = _bytes_read() - before
    assert torch.equal(fresh.weight, model.weight)
    assert size <= read < 1.5 * size, f"read {read / size:.2f}x the file"


def test_a_linked_or_fifo_checkpoint_is_refused_without_following_or_waiting(tmp_path):
    """The CRC readers open a checkpoint as every run-folder file is opened: a link is not
    followed (it is not the checkpoint), and a FIFO does not hang the check."""
    import os

    import pytest
    import torch

    from unison.checkpoint.archive import archive_complete
    from unison.checkpoint.sharded_files import file_checksum
    from unison.utils.run_files import RunFileError

    real = tmp_path / "real.pt"
    torch.save({"w": torch.arange(4.0)}, real)
    link = tmp_path / "ckpt.pt"
    link.symlink_to(real)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    assert archive_complete(real) is True
    assert archive_complete(link) is False and archive_complete(fifo) is False
    assert file_checksum(real)[0] == real.stat().st_size
    for path in (link, fifo):
        with pytest.raises(RunFileError):
            file_checksum(path)


def test_loading_a_linked_checkpoint_names_the_link_and_its_target(tmp_path):
    import pytest
    import torch

    from unison.checkpoint.archive import load_archive
    from unison.checkpoint.checkpoint_error import CheckpointError

    real = tmp_path / "real.pt"
    torch.save({"w": torch.arange(4.0)}, real)
    link = tmp_path / "ckpt.pt"
    link.symlink_to(real)
    with pytest.raises(CheckpointError, match=f"ckpt.pt is a symbolic link \\(to {real}\\).*Give the file"):
        load_archive(link)
    assert load_archive(real)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
