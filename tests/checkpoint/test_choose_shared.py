"""resume("auto") at several ranks: every rank checks a share of a sharded checkpoint's files, so no
rank reads the whole folder, and a corrupt file in any rank's share is passed over by all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _choose_workers import choose_counting, choose_with_a_failing_read
from _sharded_folders import checkpoints
from torch import nn

from unison.checkpoint.manifest import Manifest
from unison.checkpoint.sharded_check import sharded_verdict
from unison.checkpoint.sharded_files import CHECKSUMS
from unison.testing import run_distributed


def _checkpoints(tmp_path: Path) -> Manifest:
    return checkpoints(tmp_path, 2, nn.Linear(4, 3))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_shares_of_a_folder_cover_its_files_once_and_any_share_finds_a_corrupt_one(tmp_path):
    folder = _checkpoints(tmp_path).folder / "ckpt-e0002-i000000020.dcp"
    listed = sorted(json.loads((folder / CHECKSUMS).read_text())["files"])
    assert len(listed) >= 3
    assert all(sharded_verdict(folder, share=(k, 3)) is None for k in range(3))
    _flip(folder / listed[1], 5)
    found = [sharded_verdict(folder, share=(k, 2)) for k in range(2)]
    assert found[0] is None and found[1] is not None and listed[1] in found[1].text
    assert sharded_verdict(folder) is not None  # one process: the whole folder, as before


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_rank_checks_its_share_and_a_corrupt_file_in_rank_1s_share_is_passed_over_by_all(tmp_path):
    manifest = _checkpoints(tmp_path)
    newest, older = "ckpt-e0002-i000000020.dcp", "ckpt-e0001-i000000010.dcp"
    listed = sorted(json.loads((manifest.folder / newest / CHECKSUMS).read_text())["files"])
    whole = run_distributed(choose_counting, str(manifest.folder), nproc=2, timeout=90)
    assert [r["choice"] for r in whole] == [newest, newest]
    assert whole[0]["read"] == [f"{newest}/{n}" for n in listed[0::2]]
    assert whole[1]["read"] == [f"{newest}/{n}" for n in listed[1::2]]  # rank 0 never read these
    _flip(manifest.folder / newest / listed[1], 5)  # same size: only its CRC-32 tells
    damaged = run_distributed(choose_counting, str(manifest.folder), nproc=2, timeout=90)
    assert [r["choice"] for r in damaged] == [older, older]
    assert f"{newest}/{listed[1]}" in damaged[1]["read"] and f"{newest}/{listed[1]}" not in damaged[0]["read"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_read_that_fails_on_one_rank_stops_the_choice_on_every_rank_and_none_waits(tmp_path):
    """As the error would in one process: the choice stops, naming the rank and the error, rather
    than passing over a checkpoint that may be sound."""
    manifest = _checkpoints(tmp_path)
    told = run_distributed(choose_with_a_failing_read, str(manifest.folder), 1, nproc=2, timeout=90)
    assert all(t.startswith("CheckpointError: ") for t in told), told
    assert all("checking it failed on rank 1 (PermissionError" in t for t in told), told
