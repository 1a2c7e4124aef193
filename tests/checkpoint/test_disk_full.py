"""A sharded save on a full disk: an error naming the folder, the bytes needed and free; no temporary folder left.

torch reports a full disk as ``OSError(ENOSPC)`` or only as a short write from its archive
writer; each is simulated where DCP writes an item, and where rank 0 writes ``rest.pt``.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pytest
from torch import nn
from torch.distributed.checkpoint import filesystem

from unison.checkpoint import sharded
from unison.checkpoint.io import CheckpointError
from unison.checkpoint.sharded import finish_folder, temp_folder, write_shards

NEEDED = (3 * 2 + 3) * 4  # Linear(2, 3): its weight and bias, float32


def _states() -> dict:
    return {"model": nn.Linear(2, 3).state_dict()}


def _tmp(tmp_path: Path) -> Path:
    tmp = temp_folder(tmp_path / "ckpt-e0001-i000000004.dcp")
    tmp.mkdir()
    return tmp


FAILURES = {
    "no space": OSError(errno.ENOSPC, "No space left on device"),
    "short write": RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 704 vs 598"),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_full_disk_while_writing_shards_is_named_and_cleaned_up(tmp_path, monkeypatch, failure):
    def full(*args, **kwargs):
        raise FAILURES[failure]

    monkeypatch.setattr(filesystem, "_write_item", full)
    tmp = _tmp(tmp_path)
    with warnings.catch_warnings(), pytest.raises(CheckpointError) as raised:
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        write_shards(_states(), tmp)
    message = str(raised.value)
    assert f"ckpt-e0001-i000000004.dcp could not be written: the disk holding {tmp_path} is full" in message
    assert f"this rank's shards need about {NEEDED} bytes; " in message
    assert "bytes are free there" in message and f"The partial folder {tmp} was removed" in message
    assert not tmp.exists()


def test_a_full_disk_while_writing_the_rest_is_named_and_cleaned_up(tmp_path, monkeypatch):
    def full(obj, path):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded, "atomic_save", full)
    tmp = _tmp(tmp_path)
    final = tmp_path / "ckpt-e0001-i000000004.dcp"
    with pytest.raises(
        CheckpointError, match=rf"the disk holding {tmp_path} is full \(OSError: .*No space left"
    ):
        finish_folder(tmp, final, {"meta": {}}, {})
    assert not tmp.exists() and not final.exists()


def test_any_other_failure_is_raised_as_it_was_and_cleaned_up(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("not a disk problem")

    monkeypatch.setattr(filesystem, "_write_item", broken)
    tmp = _tmp(tmp_path)
    with warnings.catch_warnings(), pytest.raises(BaseException, match="not a disk problem") as raised:
        warnings.simplefilter("ignore")
        write_shards(_states(), tmp)
    assert not isinstance(raised.value, CheckpointError)
    assert not tmp.exists()


def test_a_whole_save_is_untouched(tmp_path):
    tmp = _tmp(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (written,) = write_shards(_states(), tmp).files  # one rank's files, and the metadata
    assert ".metadata" in written and tmp.is_dir()
    assert all((tmp / name).stat().st_size == size for name, (size, _) in written.items())
