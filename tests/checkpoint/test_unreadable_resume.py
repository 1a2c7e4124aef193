"""Resuming "auto" never starts afresh over checkpoints this software cannot read.

A damaged checkpoint (its save cut short) is passed over for an older one, as before. One
written whole that this software cannot read (simulated: the ``.metadata`` allow-list
refusing one of DCP's classes, as a torch release moving it would) stops the choice, naming
every such checkpoint and why, with the folder left as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _sharded_folders import checkpoints

from unison.checkpoint import sharded_check
from unison.checkpoint.io import CheckpointError
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.ranks import choose
from unison.checkpoint.sharded_files import CHECKSUMS


def _folder(tmp_path: Path, saves: int = 2) -> Manifest:
    return checkpoints(tmp_path, saves)


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_auto_picks_the_newest_whole_checkpoint(tmp_path):
    manifest = _folder(tmp_path)
    assert Path(choose(manifest, "auto")).name == "ckpt-e0002-i000000020.dcp"


def test_a_damaged_newest_is_passed_over_for_an_older_one(tmp_path, caplog):
    manifest = _folder(tmp_path)
    (manifest.folder / "ckpt-e0002-i000000020.dcp" / CHECKSUMS).unlink()  # its save did not finish
    with caplog.at_level("WARNING", logger="unison"):
        assert Path(choose(manifest, "auto")).name == "ckpt-e0001-i000000010.dcp"
    assert "ckpt-e0002-i000000020.dcp is damaged (its checksums.json is missing" in caplog.text


def test_checkpoints_this_software_cannot_read_stop_the_choice(tmp_path, monkeypatch):
    manifest = _folder(tmp_path)
    allowed = sharded_check._metadata_global
    monkeypatch.setattr(
        sharded_check,
        "_metadata_global",
        lambda module, name: None if name == "TensorStorageMetadata" else allowed(module, name),
    )
    before = _listing(manifest.folder)
    with pytest.raises(CheckpointError) as raised:
        choose(Manifest(manifest.folder), "auto")
    message = str(raised.value)
    assert "ckpt-e0002-i000000020.dcp was written whole but cannot be read by this software" in message
    assert "older ones this software cannot read either: ckpt-e0001-i000000010.dcp" in message
    assert message.count("TensorStorageMetadata, which is no part of") == 2
    assert "Nothing was resumed" in message
    assert _listing(manifest.folder) == before


def test_an_unreadable_checkpoint_behind_a_damaged_one_stops_the_choice_too(tmp_path, monkeypatch):
    manifest = _folder(tmp_path, saves=3)
    (manifest.folder / "ckpt-e0003-i000000030.dcp" / CHECKSUMS).unlink()
    shard = next((manifest.folder / "ckpt-e0002-i000000020.dcp").glob("*.distcp"))
    allowed = sharded_check._metadata_global
    monkeypatch.setattr(
        sharded_check,
        "_metadata_global",
        lambda module, name: None if name == "Metadata" else allowed(module, name),
    )
    with pytest.raises(CheckpointError, match=r"ckpt-e0002-i000000020\.dcp was written whole"):
        choose(Manifest(manifest.folder), "auto")
    assert shard.is_file()
