"""Checkpoint(every_seconds=...): saves at agreed iterations once rank 0's clock says the
interval since the last save has passed; on a fake clock (no sleeps), the saves are exact."""

from __future__ import annotations

import pytest
from _timed_workers import disagreeing_clocks, timed_saves
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from unison.engine import Engine, Events
from unison.handlers import Checkpoint
from unison.testing import run_distributed

# 48 samples in batches of 4: 12 iterations an epoch on one rank; sync points every 2.
ONE_RANK = dict(size=48, sync_every=2)


def test_saves_follow_the_clock_and_any_save_restarts_it(tmp_path):
    # One clock second per iteration. A sync point at 2, 4, 6...; the epoch's end syncs too.
    plain = timed_saves(str(tmp_path / "plain"), every_seconds=5, ticks=[1.0], **ONE_RANK)
    # 6 s at 6; 6 s more at the end of epoch 1 (12), saved after its handlers; 18; 24, and the
    # run's end adds no second save at 24.
    assert plain["saves"] == plain["asked"] == [6, 12, 18, 24]
    assert len(plain["files"]) == 4

    # An every_iters save (10, 20) restarts the clock: no timed save at 12, which would be due
    # 6 s after 6 without it; the run's end saves 24 (4 s after 20: not due).
    iters = timed_saves(
        str(tmp_path / "iters"), every_seconds=5, ticks=[1.0], checkpoint={"every_iters": 10}, **ONE_RANK
    )
    assert iters["saves"] == [6, 10, 16, 20, 24]
    assert iters["asked"] == [6, 16]

    # Epoch saves restart it as well (8 is timed, 12 the epoch's, 20 timed: 8 s after 12); a
    # timed save due at an epoch's end with an epoch save is one save (24).
    epochs = timed_saves(
        str(tmp_path / "epochs"), every_seconds=7, ticks=[1.0], checkpoint={"every_epochs": 1}, **ONE_RANK
    )
    assert epochs["saves"] == [8, 12, 20, 24]
    assert len(epochs["files"]) == len(set(epochs["files"])) == 4


def test_saves_wait_for_the_end_of_the_accumulation_window(tmp_path):
    # Without accumulation a 4 s interval saves at 4, 8, 12...; with 3 micro-batches per update
    # the sync points (and so the decisions) fall at 3, 6, 9, 12..., at the windows' ends only.
    k = 3
    result = timed_saves(str(tmp_path), every_seconds=4, ticks=[1.0], accumulation=k, **ONE_RANK)
    assert result["saves"] == [6, 12, 18, 24]
    assert all(iteration % k == 0 for iteration in result["saves"])


def test_the_interval_counts_from_the_start_of_a_save_and_waits_for_sync_points(tmp_path):
    # Each save takes 3 clock seconds: counted from its start, the next one is due 5 s after it
    # began (2 iterations later), not 5 s after it ended (5 iterations later).
    slow = timed_saves(
        str(tmp_path / "slow"),
        every_seconds=5,
        ticks=[1.0],
        max_epochs=1,
        save_takes=3.0,
        checkpoint={"async_save": True},
        size=48,
        sync_every=1,
    )
    assert slow["saves"] == [5, 7, 9, 11, 12]  # 12: the run's end

    # Without sync points inside the epoch, the decision waits for the epoch's end.
    epochs_only = timed_saves(
        str(tmp_path / "epochs"), every_seconds=5, ticks=[1.0], size=48, sync_every=None
    )
    assert epochs_only["saves"] == epochs_only["asked"] == [12, 24]


@pytest.mark.parametrize("seconds", [0, -1.5, True, "60", float("inf"), float("nan")])
def test_every_seconds_must_be_a_positive_finite_number(tmp_path, seconds):
    with pytest.raises(ValueError) as info:
        Checkpoint(
            tmp_path, {"engine": Engine(lambda e, b: None)}, Engine(lambda e, b: None), every_seconds=seconds
        )
    assert f"every_seconds={seconds!r}" in str(info.value) and "positive" in str(info.value)
    assert not any(tmp_path.iterdir()), "a refused Checkpoint touched the folder"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_whose_clocks_disagree_save_at_the_same_iterations_and_add_no_collective(tmp_path):
    # 2 ranks, 96 samples in batches of 4: 12 iterations an epoch. Rank 0's clock ticks 1 s an
    # iteration; rank 1's starts elsewhere and runs 7 times as fast: alone it would save at
    # every sync point. Rank 0's clock decides, so both save where rank 0 alone would.
    results = run_distributed(
        disagreeing_clocks,
        str(tmp_path),
        every_seconds=5,
        ticks=[1.0, 7.0],
        origins=[0.0, 1000.0],
        size=96,
        sync_every=2,
        nproc=2,
        timeout=100,
    )
    assert results[0]["epoch_length"] == 12
    assert results[0]["saves"] == results[1]["saves"] == [6, 12, 18, 24]
    assert results[0]["asked"] == results[1]["asked"]
    assert len(results[0]["files"]) == 4 and results[1]["files"] == []  # rank 0 writes the files

    # The number rides in the sync point's all-reduce: an epoch with every_seconds issues the
    # same collectives as one without it (one all-reduce per sync point, every 2 iterations).
    for rank in results:
        assert rank["with"] == rank["without"], (rank["with"], rank["without"])
        assert rank["with"]["iterations"] == 12


class _Stream(IterableDataset):
    """A stream that cannot tell where it stands."""

    def __iter__(self):  # noqa: ANN204
        yield from range(8)


def test_timed_saves_of_a_stream_that_cannot_tell_its_position_are_refused_at_started(tmp_path):
    trainer = Engine(lambda e, b: None, sync_every=2)
    trained: list[int] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: trained.append(e.state.iteration))
    Checkpoint(tmp_path, {"model": nn.Linear(2, 1)}, trainer, every_epochs=None, every_seconds=60).attach()
    with pytest.raises(ValueError) as info:
        trainer.run(DataLoader(_Stream(), batch_size=2), max_epochs=1)
    message = str(info.value)
    assert message.startswith("Checkpoint(every_seconds=60):") and "mid-epoch checkpoints" in message
    assert "every_seconds=None" in message  # the fix names it
    assert trained == [], "refused after training began"
