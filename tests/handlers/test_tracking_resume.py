"""A run killed after its last checkpoint logged past it, then resumed from that checkpoint:
MLflow and TensorBoard show each step once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from unison.engine import create_trainer
from unison.handlers.mlflow import MLflowLogger
from unison.handlers.tensorboard import TensorBoardLogger

ITERS = 3  # per epoch
STEPS = [3, 6, 9, 12]  # epoch ends of a four-epoch run


def _trainer(resume_epoch: int, max_epochs: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    data = [(torch.ones(4, 2) * i, torch.zeros(4, 1)) for i in range(ITERS)]
    if resume_epoch:  # as a checkpoint taken at that epoch's end restores it
        trainer.load_state_dict({"iteration": resume_epoch * ITERS, "epoch_length": ITERS, "max_epochs": max_epochs})
    return trainer, data


def test_mlflow_logs_no_step_twice_after_a_resume_from_an_earlier_checkpoint(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    uri, record = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}", tmp_path / "mlflow-run.json"
    trainer, data = _trainer(0, 3)  # logs epochs 1-3, "killed" after the checkpoint of epoch 1
    MLflowLogger(uri, trainer=trainer, experiment="resume", run_file=record).attach()
    trainer.run(data, max_epochs=3)
    trainer, data = _trainer(1, 4)  # resumed from epoch 1, on to epoch 4
    MLflowLogger(uri, trainer=trainer, experiment="resume", run_file=record).attach()
    trainer.run(data, max_epochs=4)

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    for key in ("train/loss", "train/lr"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == STEPS, key


def test_tensorboard_purges_what_a_killed_run_wrote_past_the_resumed_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, data = _trainer(0, 3)
    TensorBoardLogger(tmp_path, trainer=trainer).attach()
    trainer.run(data, max_epochs=3)
    trainer, data = _trainer(1, 4)
    TensorBoardLogger(tmp_path, trainer=trainer).attach()
    trainer.run(data, max_epochs=4)

    events = EventAccumulator(str(tmp_path)).Reload()
    assert "train/loss" in events.Tags()["scalars"]
    for tag in events.Tags()["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)  # each step once, in order
    assert [e.step for e in events.Scalars("train/loss")] == STEPS
