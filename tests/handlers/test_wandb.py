"""WandbLogger: one W&B run per training run, opened by rank 0 only, read back with W&B's own reader.

W&B runs offline into tmp_path (no network, no login): each run's ``.wandb`` file is read with
``wandb leet inspect --json`` (:mod:`_wandb_workers`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _sync_probe import count_host_syncs
from _wandb_workers import history, offline_env, records, run_files, train
from torch.nn import functional as F

from unison.engine import create_trainer
from unison.handlers.wandb import WandbLogger
from unison.handlers.wandb_writer import RunWriter
from unison.testing import run_distributed

pytest.importorskip("wandb")

EPOCHS = 2


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in offline_env(tmp_path).items():
        monkeypatch.setenv(name, value)


def windows(losses: list[float], points: list[int], epoch_ends: list[int]) -> list[float]:
    """The mean loss of the iterations since the previous point, or since the epoch's start."""
    means, last = [], 0
    for point in points:
        start = max([last, *[end for end in epoch_ends if end < point]])
        means.append(statistics.fmean(losses[start:point]))
        last = point
    return means


def test_a_run_holds_its_config_each_epochs_loss_validation_and_recent_loss(tmp_path: Path) -> None:
    seen = train(
        str(tmp_path),
        epochs=EPOCHS,
        sync_every=2,
        every=3,
        name="first",
        group="g",
        config={"training.lr": 0.05, "model.type": "torch.nn.Linear"},
        run_file=tmp_path / "wandb-run.json",
    )
    (file,) = run_files(tmp_path)
    found = records(file)
    (run,) = [r["run"] for r in found if r["type"] == "run"]
    assert (run["run_id"], run["display_name"], run["run_group"]) == (seen["run_id"], "first", "g")
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == {
        "training.lr": 0.05,
        "model.type": "torch.nn.Linear",
    }
    assert [r["exit"]["exit_code"] for r in found if r["type"] == "exit"] == [0]
    rows = history(found)
    ends = seen["epoch_end"]
    assert [rows[end]["train/loss"] for end in ends] == seen["epoch_loss"]
    assert [rows[end]["val/mse"] for end in ends] == seen["val"]
    points = [step for step, row in rows.items() if "train/recent_loss" in row]
    assert points == [4, 8, 10]  # the first sync point at or after every 3rd iteration, never an epoch's end
    assert [rows[p]["train/recent_loss"] for p in points] == pytest.approx(
        windows(seen["losses"], points, ends)
    )
    assert all(row["train/lr"] == 0.05 for row in rows.values())
    record = json.loads((tmp_path / "wandb-run.json").read_text())
    assert record == {"id": seen["run_id"], "project": "unison-tests", "entity": None}


def test_nothing_is_read_from_the_device_between_sync_points(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, sync_every=100)
    WandbLogger("unison-tests", trainer=trainer, every=1, directory=tmp_path).attach(trainer)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
    with count_host_syncs() as syncs:
        trainer.run(data, max_iters=4, epoch_length=100)
    assert syncs.count == 0, syncs.calls
    assert len(run_files(tmp_path)) == 1


class _SlowRun:
    """A run whose ``log`` takes 50 ms, as W&B's can when its service process is busy."""

    id = "slow"

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.exit_code: int | None = None

    def log(self, values: dict[str, float], step: int) -> None:
        time.sleep(0.05)
        self.rows.append((step, values))

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code

    def mark_preempting(self) -> None:
        self.exit_code = -1


def test_the_writer_thread_takes_the_wait_and_skips_steps_the_run_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import wandb

    stopped: list[None] = []
    monkeypatch.setattr(wandb, "teardown", lambda: stopped.append(None))
    run = _SlowRun()
    writer = RunWriter(run, last_step=3)
    start = time.perf_counter()
    writer.points({2: {"a": 1.0}, 3: {"a": 2.0}, 6: {"a": 3.0}, 9: {"a": 4.0}})
    handed = time.perf_counter() - start
    assert writer.finish("FINISHED")
    assert handed < 0.05 and run.rows == [(6, {"a": 3.0}), (9, {"a": 4.0})]  # 2 and 3: logged before
    assert run.exit_code == 0
    # W&B's service stopped with the run: a rank's process leaves without exit handlers, and the
    # service would hold the launcher's output open for a minute.
    assert stopped == [None]


@pytest.mark.parametrize(("status", "exit_code"), [("KILLED", 1), ("FAILED", 1)])
def test_a_preempted_run_is_marked_preempting_and_a_failed_one_ends_with_exit_code_1(
    status: str, exit_code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    monkeypatch.setattr(wandb, "teardown", lambda: None)
    run = _SlowRun()
    marks: list[str] = []
    monkeypatch.setattr(run, "mark_preempting", lambda: marks.append("preempting"))
    assert RunWriter(run, last_step=-1).finish(status)
    assert run.exit_code == exit_code and marks == (["preempting"] if status == "KILLED" else [])


def test_a_resumed_run_continues_the_recorded_run_logging_no_step_twice(tmp_path: Path) -> None:
    """Killed after its checkpoint at epoch 1 had logged epochs 1-3, resumed from epoch 1 to 4."""
    record = tmp_path / "wandb-run.json"
    steps = []
    for resume_epoch, max_epochs in ((0, 3), (1, 4)):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
        data = [(torch.ones(4, 2) * i, torch.zeros(4, 1)) for i in range(3)]
        if resume_epoch:
            trainer.load_state_dict(
                {"iteration": resume_epoch * 3, "epoch_length": 3, "max_epochs": max_epochs}
            )
        logger = WandbLogger("unison-tests", trainer=trainer, directory=tmp_path, run_file=record)
        logger.attach()
        trainer.run(data, max_epochs=max_epochs)
        steps.append(logger.run_id)
    first, second = run_files(tmp_path)
    assert steps[0] == steps[1] and {f.stem for f in (first, second)} == {f"run-{steps[0]}"}
    assert list(history(first)) == [3, 6, 9] and list(history(second)) == [12]


def _epochs(folder: Path, record: Path, resume_epoch: int, max_epochs: int) -> str | None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    data = [(torch.ones(4, 2) * i, torch.zeros(4, 1)) for i in range(3)]
    if resume_epoch:
        trainer.load_state_dict({"iteration": resume_epoch * 3, "epoch_length": 3, "max_epochs": max_epochs})
    logger = WandbLogger("unison-tests", trainer=trainer, directory=folder, run_file=record)
    logger.attach()
    trainer.run(data, max_epochs=max_epochs)
    return logger.run_id


def _latest(folder: Path, run_id: str | None) -> Path:
    return [f for f in run_files(folder) if f.stem == f"run-{run_id}"][-1]


def test_a_crafted_record_or_step_in_the_run_folder_cannot_silence_a_resumed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import unison.handlers.wandb as wandb_logger

    record = tmp_path / "wandb-run.json"
    run_id = _epochs(tmp_path, record, 0, 1)
    crafted = {"id": run_id, "project": "unison-tests", "entity": None, "last_step": 10**15}
    record.write_text(json.dumps(crafted))  # a step the record no longer says anything about
    assert _epochs(tmp_path, record, 1, 2) == run_id  # the same W&B run, continued
    assert list(history(_latest(tmp_path, run_id))) == [6]

    record.write_text(json.dumps({**crafted, "id": "../../elsewhere"}))  # no W&B run's id
    with caplog.at_level("WARNING", logger="unison.handlers.wandb"):
        other = _epochs(tmp_path, record, 2, 3)
    assert other != run_id and f"{record} does not hold a W&B run's id" in caplog.text
    assert list(history(_latest(tmp_path, other))) == [9]  # a new W&B run

    caplog.clear()  # W&B's files claiming a step no run of 4 epochs of 3 reaches: ignored, said
    fake = tmp_path / "wandb" / "offline-run-x" / "run-x.wandb"
    monkeypatch.setattr(wandb_logger, "last_written_step", lambda folder, rid: (10**15, fake))
    with caplog.at_level("WARNING", logger="unison.handlers.wandb"):
        assert _epochs(tmp_path, record, 3, 4) == other
    assert (
        f"{fake} holds step {10**15}" in caplog.text
        and "past the last step this run can reach (12)" in caplog.text
    )
    assert list(history(_latest(tmp_path, other))) == [12]


def test_bad_arguments_are_refused_with_the_fix() -> None:
    model = torch.nn.Linear(1, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, sync_every=None)
    with pytest.raises(ValueError, match="mode='cloud'.*online, offline, disabled"):
        WandbLogger("p", trainer=trainer, mode="cloud")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="project=''"):
        WandbLogger("", trainer=trainer)
    with pytest.raises(ValueError, match="sync_every=None"):
        WandbLogger("p", trainer=trainer, every=5)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_at_two_ranks_one_run_from_rank_0_with_values_agreed_by_all_ranks(tmp_path: Path) -> None:
    ranks: list[dict[str, Any]] = run_distributed(
        train, str(tmp_path), nproc=2, timeout=180, epochs=EPOCHS, sync_every=2, every=2
    )
    (file,) = run_files(tmp_path)  # one run, from rank 0
    assert [r["run_id"] for r in ranks] == [file.stem.removeprefix("run-"), None]
    assert [r["imported"] for r in ranks] == [True, False]  # rank 1 never imports W&B
    assert ranks[0]["epoch_loss"] == ranks[1]["epoch_loss"]  # agreed at the sync point
    rows = history(file)
    assert [rows[end]["train/loss"] for end in ranks[0]["epoch_end"]] == ranks[0]["epoch_loss"]
    per_iteration = [
        statistics.fmean(pair) for pair in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)
    ]
    points = [step for step, row in rows.items() if "train/recent_loss" in row]
    assert points == [2, 4, 8, 10]  # not 6 nor 12: epoch ends
    assert [rows[p]["train/recent_loss"] for p in points] == pytest.approx(
        windows(per_iteration, points, ranks[0]["epoch_end"])
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rows_lost_with_a_killed_job_are_logged_again_by_the_resumed_run(tmp_path: Path) -> None:
    """The job killed with W&B's service after epoch 3's row was handed over, before W&B wrote it;
    resumed from epoch 2's checkpoint: W&B's files hold every epoch once."""
    import subprocess
    import sys

    worker = Path(__file__).with_name("_wandb_kill.py")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")]),
    }
    killed = subprocess.run(
        [sys.executable, str(worker), str(tmp_path), "killed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    per_epoch = 3  # iterations an epoch in _wandb_kill.py
    assert killed.stdout.split() == ["written", str(2 * per_epoch)]  # epoch 3's row handed, not written
    resumed = subprocess.run(
        [sys.executable, str(worker), str(tmp_path), "resumed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = []
    for file in run_files(tmp_path):
        steps += [step for step, row in history(file).items() if "train/loss" in row]
    assert sorted(steps) == [per_epoch * epoch for epoch in (1, 2, 3, 4)], steps  # epoch 3 once, not lost
