"""Per-rank state: a handler that declares ``per_rank_state = True`` gets its own state back on
every rank, at no extra collective; at another world size its ``load_state_dict_resharded``
decides, or the resume is refused on every rank naming it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # _collective_probe
from _per_rank_workers import (  # noqa: E402
    count_save_collectives,
    resume_at_this_size,
    save_at_two,
    save_then_resume,
)

from unison.checkpoint import CheckpointError  # noqa: E402
from unison.checkpoint.per_rank import check_rank_objects, load_own, rank_entries  # noqa: E402
from unison.testing import run_distributed  # noqa: E402


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_each_rank_resumes_its_own_state(tmp_path: Path) -> None:
    ranks = run_distributed(save_then_resume, str(tmp_path), "RankTally", nproc=2, timeout=100)
    assert ranks[0]["trained"] != ranks[1]["trained"]
    for rank in ranks:
        assert rank["resumed"] == rank["trained"], rank


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_without_the_declaration_every_rank_resumes_rank_zeros_state(tmp_path: Path) -> None:
    ranks = run_distributed(save_then_resume, str(tmp_path), "SharedTally", nproc=2, timeout=100)
    assert [r["resumed"] for r in ranks] == [ranks[0]["trained"]] * 2


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_save_with_a_per_rank_handler_issues_no_extra_collective(tmp_path: Path) -> None:
    for counts in run_distributed(count_save_collectives, str(tmp_path), nproc=2, timeout=100):
        assert counts["with"] == counts["without"], counts
        assert counts["with"], "the probe saw the save's collectives"


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_another_world_size_is_refused_naming_the_handler(tmp_path: Path) -> None:
    run_distributed(save_at_two, str(tmp_path), "RankTally", nproc=2, timeout=100)
    (answer,) = [resume_at_this_size(str(tmp_path), "RankTally")]  # one rank, in this process
    assert (
        "handler:RankTally" in answer["error"]
        and "RankTally defines no load_state_dict_resharded" in (answer["error"])
    )
    assert "world size 2" in answer["error"] and "world size 1" in answer["error"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_another_world_size_is_decided_by_the_reshard_hook(tmp_path: Path) -> None:
    saved = run_distributed(save_at_two, str(tmp_path), "ReshardedTally", nproc=2, timeout=100)
    answer = resume_at_this_size(str(tmp_path), "ReshardedTally")
    assert answer["seen"] == saved
    assert answer["tally"] == sum(saved)


def test_rank_entries_and_load_own_are_one_state_per_rank() -> None:
    gathered = [{"data": None, "h": {"v": 0}}, {"data": None, "h": {"v": 1}}]
    entries = rank_entries(gathered, 2)
    assert entries == {"h": {"world_size": 2, "by_rank": [{"v": 0}, {"v": 1}]}}
    got: list[object] = []
    load_own(entries["h"], 1, 2, load=got.append, reshard=None)
    assert got == [{"v": 1}]
    with pytest.raises(CheckpointError):
        load_own(entries["h"], 0, 3, load=got.append, reshard=None)


def test_a_damaged_per_rank_entry_is_refused() -> None:
    state = {
        "meta": {"world_size": 2, "per_rank": ["h"]},
        "objects": {"h": {"world_size": 2, "by_rank": [{}]}},
    }
    with pytest.raises(CheckpointError, match="objects.h is listed as per-rank state"):
        check_rank_objects({"h": object()}, state, source="ckpt.pt", world_size=2)
