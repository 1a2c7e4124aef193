"""unison/recipe/build/history.py: a run's validation history is complete across resumes, each epoch once.

A run killed between checkpoints validated epochs past the checkpoint it is resumed from; the
resumed run validates them again. Its ``metrics.json`` lists every epoch of the run once, as
the uninterrupted run's does, and its TensorBoard scalars, read by ``unison plot``'s reader and
by TensorBoard's, hold each step once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli_parts import config, planned
from ignite.engine import Engine, Events

from unison.recipe.build.assemble import RunParts
from unison.recipe.build.history import HISTORY_FILE, RunHistory, read_rows
from unison.recipe.phases import _train
from unison.utils.event_files import read_scalars

EPOCHS, ITERS = 4, 3  # four epochs of three iterations


def _engine(epoch: int) -> Engine:
    engine = Engine(lambda e, b: None)
    engine.load_state_dict({"iteration": epoch * ITERS, "epoch_length": ITERS, "max_epochs": EPOCHS})
    return engine


def _rows(*epochs: int, loss: float = 0.5) -> list[dict[str, Any]]:
    return [{"epoch": e, "train_loss": loss / e, "val_accuracy": e / 10} for e in epochs]


def test_rows_past_the_resumed_epoch_are_dropped_from_the_history_and_its_file(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = []
    history = RunHistory(tmp_path, rows)
    for row in _rows(1, 2, 3):  # a run killed after validating epoch 3, its last checkpoint at epoch 2
        history.append(row)
    assert read_rows(tmp_path / HISTORY_FILE) == _rows(1, 2, 3)

    resumed: list[dict[str, Any]] = []
    again = RunHistory(tmp_path, resumed)
    engine = _engine(2)
    again.attach(engine)
    again.attach(engine)  # attached once
    engine.fire_event(Events.STARTED)
    assert resumed == _rows(1, 2)
    assert read_rows(tmp_path / HISTORY_FILE) == _rows(1, 2)  # the file forgets epoch 3 too
    again.append(_rows(3, loss=0.25)[0])
    assert read_rows(tmp_path / HISTORY_FILE) == resumed == _rows(1, 2) + _rows(3, loss=0.25)


def test_a_line_cut_short_by_a_kill_ends_the_history_and_is_not_appended_to(tmp_path: Path) -> None:
    path = tmp_path / HISTORY_FILE
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(1, 2)) + '{"epoch": 3, "train_lo')
    rows: list[dict[str, Any]] = []
    history = RunHistory(tmp_path, rows)
    history.restore(3)
    assert rows == _rows(1, 2)
    history.append(_rows(3)[0])
    assert read_rows(path) == _rows(1, 2, 3)


def test_a_fresh_start_has_no_history(tmp_path: Path) -> None:
    (tmp_path / HISTORY_FILE).write_text(json.dumps(_rows(1)[0]) + "\n")
    rows = _rows(5)
    RunHistory(tmp_path, rows).restore(0)  # training from scratch in the same folder
    assert rows == [] and read_rows(tmp_path / HISTORY_FILE) == []
    RunHistory(tmp_path / "new", rows).restore(0)
    assert not (tmp_path / "new").exists()  # nothing written where nothing was


# -- a run killed between checkpoints, resumed ----------------------------------------------------


class Killed(RuntimeError):
    pass


def _kill_after(epoch: int):
    """``attach`` for ``_train``: the run dies at the end of ``epoch``, after validating it."""

    def attach(parts: RunParts) -> None:
        def die(engine: Engine) -> None:
            if engine.state.epoch == epoch:
                raise Killed(f"killed after epoch {epoch}")

        parts.trainer.add_event_handler(Events.EPOCH_COMPLETED, die)

    return attach


def _config(run_dir: Path):
    c = config(run_dir)
    c.training.max_epochs = EPOCHS
    c.checkpoint.every_epochs = 2  # checkpoints at epochs 2 and 4
    c.checkpoint.keep_last = None
    c.logging.tensorboard = True
    return c


@pytest.mark.slow  # three short runs in one process: a few seconds
def test_a_run_killed_between_checkpoints_and_resumed_records_each_epoch_once(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _train(planned(_config(whole)), whole, None)
    with pytest.raises(Exception, match="killed after epoch 3"):
        _train(planned(_config(broken)), broken, None, _kill_after(3))
    assert [row["epoch"] for row in read_rows(broken / HISTORY_FILE)] == [1, 2, 3]
    resumed = _train(planned(_config(broken)), broken, "auto")

    expected = json.loads((whole / "metrics.json").read_text())
    written = json.loads((broken / "metrics.json").read_text())
    assert [row["epoch"] for row in expected["history"]] == [1, 2, 3, 4]
    assert (
        written["history"] == expected["history"] == resumed["history"]
    )  # every epoch, once, the same values
    assert {k: v for k, v in written.items() if k != "run_dir"} == {
        k: v for k, v in expected.items() if k != "run_dir"
    }

    ours, theirs = read_scalars(broken / "tb"), EventAccumulator(str(broken / "tb")).Reload()
    assert set(ours) == set(theirs.Tags()["scalars"]) and "val/accuracy" in ours
    for tag, points in ours.items():
        assert points == [(e.step, e.value) for e in theirs.Scalars(tag)], tag
        assert [step for step, _ in points] == sorted({step for step, _ in points}), tag  # each step once
    assert ours["train/loss"] == read_scalars(whole / "tb")["train/loss"]
    assert [step for step, _ in ours["train/loss"]] == [ITERS * e for e in range(1, EPOCHS + 1)]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rank_zero_alone_writes_the_file_and_every_rank_gets_its_rows(tmp_path: Path) -> None:
    from _history_workers import killed_and_restored

    from unison.testing import run_distributed

    ranks = run_distributed(killed_and_restored, str(tmp_path), nproc=2, timeout=90)
    assert [r["lines"] for r in ranks] == [3, 0]  # the other rank's folder holds no file
    assert ranks[0]["written"] == ranks[1]["written"] and len(ranks[1]["written"]) == 3
    assert ranks[0]["restored"] == ranks[1]["restored"] == ranks[0]["written"][:2]
