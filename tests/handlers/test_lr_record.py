"""train/lr in TensorBoard and MLflow is the learning rate the last update used.

The truth is recorded by the test's own step pre-hook, registered after every handler's
(so it sees the rate the update steps with, warmup factor included): each logged point must
equal the rate of the last update before it, with a warmup, with a scheduler that steps at
the epoch's end before the logger's handler, and with a tensor learning rate that a
scheduler changes in place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from unison.engine import Engine, Events, create_trainer
from unison.handlers import LRWarmup, MLflowLogger, TensorBoardLogger
from unison.handlers.lr_record import _RECORDS, LRRecord, used_rates
from unison.utils.event_files import read_scalars

ITERS = 6  # per epoch
DATA = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(ITERS)]


def _train(
    attach_logger: Callable[[Engine], None],
    *,
    lr: Any = 0.04,
    warmup: int = 0,
    warmup_first: bool = True,
    epoch_scheduler: bool = False,
    epochs: int = 1,
    sync_every: int | None = None,
) -> list[Any]:
    """Trains; returns the rate each update used (as its step began, after every other hook)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    trainer = create_trainer(model, optimizer, F.mse_loss, sync_every=sync_every)
    if epoch_scheduler:  # before the logger: the groups hold the next epoch's rate at its handler
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: sched.step())
    if warmup and warmup_first:
        LRWarmup(optimizer, warmup).attach(trainer)
    attach_logger(trainer)
    if warmup and not warmup_first:
        LRWarmup(optimizer, warmup).attach(trainer)
    used: list[Any] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: used.append(float(opt.param_groups[0]["lr"])))
    trainer.run(DATA, max_epochs=epochs)
    return used


def _tb(folder: Path) -> Callable[[Engine], None]:
    return lambda trainer: TensorBoardLogger(folder, trainer=trainer, log_every=1).attach(trainer)


@pytest.mark.parametrize("warmup_first", [True, False], ids=["warmup-then-logger", "logger-then-warmup"])
def test_tensorboard_logs_the_warmed_up_rate_each_update_used(tmp_path: Path, warmup_first: bool) -> None:
    used = _train(_tb(tmp_path), warmup=4, warmup_first=warmup_first)
    assert used == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.04, 0.04])
    points = read_scalars(tmp_path)["train/lr"]
    assert [step for step, _ in points] == list(range(1, ITERS + 1))
    assert [value for _, value in points] == pytest.approx(used)


def test_at_an_epochs_end_tensorboard_logs_the_rate_of_the_epochs_last_update(tmp_path: Path) -> None:
    used = _train(_tb(tmp_path), lr=0.1, epoch_scheduler=True, epochs=3)
    assert used == pytest.approx([0.1] * ITERS + [0.05] * ITERS + [0.025] * ITERS)
    ends = [(step, value) for step, value in read_scalars(tmp_path)["train/lr"] if step % ITERS == 0]
    assert ends == [
        (ITERS, pytest.approx(0.1)),
        (2 * ITERS, pytest.approx(0.05)),
        (3 * ITERS, pytest.approx(0.025)),
    ]


def test_a_tensor_rate_changed_in_place_by_its_scheduler_is_logged_as_used(tmp_path: Path) -> None:
    used = _train(_tb(tmp_path), lr=torch.tensor(0.1), epoch_scheduler=True, epochs=2)
    assert used == pytest.approx([0.1] * ITERS + [0.05] * ITERS)
    ends = [(step, value) for step, value in read_scalars(tmp_path)["train/lr"] if step % ITERS == 0]
    assert ends == [(ITERS, pytest.approx(0.1)), (2 * ITERS, pytest.approx(0.05))]


def test_before_any_update_the_groups_rate_is_logged() -> None:
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (0.1, 0.2)]
    optimizer = torch.optim.SGD(groups, lr=0.3)
    LRRecord.of(optimizer)
    assert used_rates(optimizer) == {"train/lr/0": 0.1, "train/lr/1": 0.2}
    optimizer.step()
    optimizer.param_groups[1]["lr"] = 0.5
    assert used_rates(optimizer) == {"train/lr/0": 0.1, "train/lr/1": 0.2}


def test_only_an_optimizer_a_logger_reads_is_recorded_once_however_many_loggers(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, F.mse_loss)
    LRWarmup(optimizer, 4).attach(trainer)
    assert optimizer not in _RECORDS  # no logger: no hook, no cost per step
    TensorBoardLogger(tmp_path / "a", trainer=trainer).attach(trainer)
    record = _RECORDS[optimizer]
    TensorBoardLogger(tmp_path / "b", trainer=trainer).attach(trainer)
    assert _RECORDS[optimizer] is record
    calls: list[int] = []
    original = record.keep
    record.keep = lambda opt: (calls.append(1), original(opt))[1]  # type: ignore[method-assign]
    trainer.run(DATA, max_epochs=1)
    # one record per step, and the warmup's note while its factor is not 1 (updates 1 to 3)
    assert len(calls) == ITERS + 3


# -- MLflow ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()  # makes the tables once
    return uri


def _mlflow_lr(uri: str, experiment: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    (run,) = client.search_runs([found.experiment_id])
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/lr"))


def _mlflow(uri: str, experiment: str, every: int | None) -> Callable[[Engine], None]:
    def attach(trainer: Engine) -> None:
        MLflowLogger(uri, trainer=trainer, experiment=experiment, every=every).attach(trainer)

    return attach


def test_mlflow_logs_the_warmed_up_rate_each_update_used(store: str, request: pytest.FixtureRequest) -> None:
    used = _train(_mlflow(store, request.node.name, every=1), warmup=4, sync_every=1)
    assert used == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.04, 0.04])
    points = _mlflow_lr(store, request.node.name)
    assert [step for step, _ in points] == list(range(1, ITERS + 1))
    assert [value for _, value in points] == pytest.approx(used)


def test_at_an_epochs_end_mlflow_logs_the_rate_of_the_epochs_last_update(
    store: str, request: pytest.FixtureRequest
) -> None:
    used = _train(_mlflow(store, request.node.name, every=None), lr=0.1, epoch_scheduler=True, epochs=2)
    assert used == pytest.approx([0.1] * ITERS + [0.05] * ITERS)
    assert _mlflow_lr(store, request.node.name) == [
        (ITERS, pytest.approx(0.1)),
        (2 * ITERS, pytest.approx(0.05)),
    ]
