"""resume("auto") at several ranks: every rank checks a share of a sharded checkpoint's files (the
data files it wrote, which its load reads next), so no rank reads the whole folder, and a corrupt
file in any rank's share is passed over by all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _choose_workers import choose_counting, choose_with_a_failing_read
from _sharded_folders import checkpoints
from torch import nn

from unison.checkpoint.manifest import Manifest
from unison.checkpoint.sharded_check import sharded_verdict, share_of
from unison.checkpoint.sharded_files import CHECKSUMS
from unison.testing import run_distributed


def _checkpoints(tmp_path: Path) -> Manifest:
    """Two sharded checkpoints whose data file rank 1 wrote: rank 1's share at 2 ranks."""
    return checkpoints(tmp_path, 2, nn.Linear(4, 3), writer=1)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_shares_cover_a_folders_files_once_each_data_file_with_the_rank_that_wrote_it(world):
    names = [".metadata", "rest.pt", "extra.bin"] + [f"__{r}_{i}.distcp" for r in range(4) for i in range(2)]
    shares = [share_of(names, (k, world)) for k in range(world)]
    assert sorted(n for share in shares for n in share) == sorted(names)  # every file, once
    for k, share in enumerate(shares):
        written = [n for n in share if n.endswith(".distcp")]
        assert written == [f"__{r}_{i}.distcp" for r in range(4) if r % world == k for i in range(2)]
    assert {".metadata", "rest.pt", "extra.bin"} <= set(shares[0])


def test_any_share_finds_a_corrupt_file_of_its_own(tmp_path):
    folder = _checkpoints(tmp_path).folder / "ckpt-e0002-i000000020.dcp"
    assert all(sharded_verdict(folder, share=(k, 3)) is None for k in range(3))
    _flip(folder / "__1_0.distcp", 5)
    found = [sharded_verdict(folder, share=(k, 2)) for k in range(2)]
    assert found[0] is None and found[1] is not None and "__1_0.distcp" in found[1].text
    assert sharded_verdict(folder) is not None  # one process: the whole folder, as before


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_rank_checks_its_share_and_a_corrupt_file_in_rank_1s_share_is_passed_over_by_all(tmp_path):
    manifest = _checkpoints(tmp_path)
    newest, older = "ckpt-e0002-i000000020.dcp", "ckpt-e0001-i000000010.dcp"
    listed = sorted(json.loads((manifest.folder / newest / CHECKSUMS).read_text())["files"])
    assert listed == [".metadata", "__1_0.distcp", "rest.pt"]
    whole = run_distributed(choose_counting, str(manifest.folder), nproc=2, timeout=90)
    assert [r["choice"] for r in whole] == [newest, newest]
    assert whole[0]["read"] == [f"{newest}/.metadata", f"{newest}/rest.pt"]
    assert whole[1]["read"] == [f"{newest}/__1_0.distcp"]  # rank 0 never read it
    _flip(manifest.folder / newest / "__1_0.distcp", 5)  # same size: only its CRC-32 tells
    damaged = run_distributed(choose_counting, str(manifest.folder), nproc=2, timeout=90)
    assert [r["choice"] for r in damaged] == [older, older]
    assert f"{newest}/__1_0.distcp" in damaged[1]["read"]
    assert f"{newest}/__1_0.distcp" not in damaged[0]["read"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_read_that_fails_on_one_rank_stops_the_choice_on_every_rank_and_none_waits(tmp_path):
    """As the error would in one process: the choice stops, naming the rank and the error, rather
    than passing over a checkpoint that may be sound."""
    manifest = _checkpoints(tmp_path)
    told = run_distributed(choose_with_a_failing_read, str(manifest.folder), 1, nproc=2, timeout=90)
    assert all(t.startswith("CheckpointError: ") for t in told), told
    assert all("checking it failed on rank 1 (PermissionError" in t for t in told), told
