"""A stream of the user's own with state_dict() in a StatefulDataLoader, saved at 2 ranks mid-epoch
and resumed at 3: a stream that declares its position global continues (each record once),
one with a per-rank offset is refused on every rank at once, naming both world sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _custom_stream_workers import SIZE, EveryWth, FileOffset, resume, save_mid_epoch  # noqa: E402

from unison.distributed.data_state import data_position  # noqa: E402
from unison.testing import run_distributed  # noqa: E402

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def test_a_stream_that_declares_a_global_position_is_elastic_without_workers():
    position = data_position(StatefulDataLoader(EveryWth(), batch_size=2))
    assert (position.kind, position.scope, position.elastic) == ("stateful", "global", True)
    workers = data_position(StatefulDataLoader(EveryWth(), batch_size=2, num_workers=2))
    assert (workers.scope, workers.elastic) == ("rank", False) and "num_workers=2" in workers.not_elastic
    own = data_position(StatefulDataLoader(FileOffset(), batch_size=2))
    assert (own.scope, own.elastic) == ("rank", False)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_global_stream_position_saved_at_two_ranks_continues_at_three(tmp_path):
    saved = run_distributed(save_mid_epoch, str(tmp_path / "two"), "every-wth", 3, nproc=2, timeout=90)
    path = saved[0]["path"]
    resumed = run_distributed(resume, str(tmp_path / "three"), "every-wth", path, nproc=3, timeout=90)
    assert all("error" not in r for r in resumed), [r.get("error") for r in resumed]
    before = [i for r in saved for batch in r["trained"] for i in batch]
    after = [i for r in resumed for batch in r["trained"] for i in batch]
    assert sorted(before + after) == list(range(SIZE)), "a record trained twice or never"
    assert len({len(r["trained"]) for r in resumed}) == 1, "the ranks trained different numbers of batches"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_per_rank_stream_position_is_refused_at_three_ranks_on_every_rank(tmp_path):
    saved = run_distributed(save_mid_epoch, str(tmp_path / "two"), "file-offset", 3, nproc=2, timeout=90)
    resumed = run_distributed(
        resume, str(tmp_path / "three"), "file-offset", saved[0]["path"], nproc=3, timeout=90
    )
    for rank, result in enumerate(resumed):
        message = result.get("error")
        assert message is not None, f"rank {rank} resumed a per-rank position at another world size"
        assert "world size 2" in message and "world size 3" in message


def test_a_global_position_meeting_per_rank_data_at_another_world_size_is_refused(monkeypatch):
    """Saved without workers (global), resumed at 3 ranks with workers (per rank): refused, not half-loaded."""
    import unison.checkpoint.data_entry as data_entry
    from unison.checkpoint import CheckpointError

    saved = data_entry.DataEntry()
    saved.run_started(StatefulDataLoader(EveryWth(), batch_size=2))
    entry = saved.entry([saved.local(), saved.local()], 2)
    assert entry is not None and entry["elastic"]
    monkeypatch.setattr(data_entry, "get_world_size", lambda: 3)
    now = data_entry.DataEntry()
    now.run_started(StatefulDataLoader(EveryWth(), batch_size=2, num_workers=2))
    with pytest.raises(CheckpointError, match=r"world size 2; this run has world size 3.*num_workers=2"):
        now.load(entry, 2, mid_epoch=True, source="ckpt.pt")
