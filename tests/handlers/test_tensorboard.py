"""TensorBoardLogger: the trainer's and evaluators' scalars, written by rank 0 only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _sync_probe import count_host_syncs
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from unison.distributed import get_rank
from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers.tensorboard import TensorBoardLogger
from unison.metrics import Loss, MeanSquaredError
from unison.testing import run_distributed
from unison.utils.event_files import event_files, read_scalars

N_SAMPLES, BATCH, EPOCHS = 12, 4, 3
ITERS = N_SAMPLES // BATCH  # per epoch




def _data(scale: float = 1.0) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, 3, generator=gen)
    return TensorDataset(x, scale * x.sum(dim=1, keepdim=True))


def _run(log_dir: Path, *, scale: float = 1.0, **logger_kwargs: Any) -> dict[str, Any]:
    """A tiny training run with validation at every epoch; returns what the engines saw."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, F.mse_loss, clip_grad_norm=10.0)
    evaluator = create_evaluator(model, {"mse": MeanSquaredError(), "loss": Loss(F.mse_loss)})
    loader = DataLoader(_data(scale), batch_size=BATCH)
    logger = TensorBoardLogger(log_dir, trainer=trainer, evaluators={"val": evaluator}, **logger_kwargs)
    logger.attach(trainer)
    seen: dict[str, Any] = {"loss": [], "val": [], "grad_norm": []}

    def _validate(engine: Engine) -> None:
        evaluator.run(loader)
        seen["loss"].append(engine.state.metrics["loss"])
        seen["val"].append(dict(evaluator.state.metrics))
        seen["grad_norm"].append(float(engine.process_function.grad_norm))

    trainer.add_event_handler(Events.EPOCH_COMPLETED, _validate)
    trainer.run(loader, max_epochs=EPOCHS)
    seen["logger"] = logger
    return seen


def _steps(points: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in points]


def _values(points: list[tuple[int, float]]) -> list[float]:
    return [value for _, value in points]


def test_writes_training_and_validation_scalars(tmp_path):
    seen = _run(tmp_path / "tb", log_every=2)
    scalars = read_scalars(tmp_path / "tb")
    assert set(scalars) == {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/samples_per_second",
        "train/epoch_time_s",
        "val/mse",
        "val/loss",
    }
    epoch_ends = [ITERS * e for e in range(1, EPOCHS + 1)]
    for tag in ("train/loss", "train/grad_norm", "train/samples_per_second", "train/epoch_time_s"):
        assert _steps(scalars[tag]) == epoch_ends, tag
    # the epoch's agreed mean loss, as float32
    assert _values(scalars["train/loss"]) == pytest.approx(seen["loss"], rel=1e-6)
    assert _values(scalars["train/grad_norm"]) == pytest.approx(seen["grad_norm"], rel=1e-6)
    assert all(v > 0 and math.isfinite(v) for v in _values(scalars["train/grad_norm"]))
    # every 2 iterations, and at each epoch's end; the epoch's end is not written twice
    assert _steps(scalars["train/lr"]) == [2, 3, 4, 6, 8, 9]
    assert _values(scalars["train/lr"]) == pytest.approx([0.05] * 6)
    for (_, sps), (_, seconds) in zip(
        scalars["train/samples_per_second"], scalars["train/epoch_time_s"], strict=True
    ):
        assert seconds > 0
        assert sps * seconds == pytest.approx(ITERS * BATCH, rel=1e-5)
    # validation, at the trainer's iteration
    for name in ("mse", "loss"):
        assert _steps(scalars[f"val/{name}"]) == epoch_ends
        assert _values(scalars[f"val/{name}"]) == pytest.approx([m[name] for m in seen["val"]], rel=1e-6)
    assert len(event_files(tmp_path / "tb")) == 1
    assert seen["logger"]._writer is None  # closed at COMPLETED


def test_no_host_sync_during_iterations(tmp_path):
    """Stopping before the epoch's end: the logger (lr every iteration) reads no device value."""
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, F.mse_loss, clip_grad_norm=1.0)
    TensorBoardLogger(tmp_path, trainer=trainer, log_every=1).attach(trainer)
    batches = [(torch.randn(BATCH, 3), torch.randn(BATCH, 1)) for _ in range(5)]
    with count_host_syncs() as syncs:
        trainer.run(batches, max_iters=4, epoch_length=100)
    assert syncs.count == 0, syncs.calls
    assert _steps(read_scalars(tmp_path)["train/lr"]) == [1, 2, 3, 4]


def test_every_param_group_has_its_lr(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.01}]
    )
    trainer = create_trainer(model, optimizer, F.mse_loss)
    TensorBoardLogger(tmp_path, trainer=trainer, log_every=None).attach(trainer)
    trainer.run(DataLoader(_data(), batch_size=BATCH), max_epochs=2)
    scalars = read_scalars(tmp_path)
    assert scalars["train/lr/0"] == [(ITERS, pytest.approx(0.1)), (2 * ITERS, pytest.approx(0.1))]
    assert scalars["train/lr/1"] == [(ITERS, pytest.approx(0.01)), (2 * ITERS, pytest.approx(0.01))]
    assert "train/lr" not in scalars
    assert "train/grad_norm" not in scalars  # no clip_grad_norm: no norm computed


def test_attach_twice_writes_each_point_once(tmp_path):
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    logger = TensorBoardLogger(tmp_path, trainer=trainer, log_every=1)
    logger.attach(trainer)
    logger.attach()
    trainer.run(DataLoader(_data(), batch_size=BATCH), max_epochs=2)
    scalars = read_scalars(tmp_path)
    assert _steps(scalars["train/loss"]) == [ITERS, 2 * ITERS]
    assert _steps(scalars["train/lr"]) == list(range(1, 2 * ITERS + 1))


def test_any_engine_logs_what_it_has(tmp_path):
    """A plain engine has no optimizer, loss or batch size: only the epoch time is written."""
    engine = Engine(lambda e, b: b)
    TensorBoardLogger(tmp_path, trainer=engine).attach(engine)
    engine.run([1, 2, 3], max_epochs=2)
    assert set(read_scalars(tmp_path)) == {"train/epoch_time_s"}


def test_batch_size_argument_gives_throughput_without_a_dataloader(tmp_path):
    engine = Engine(lambda e, b: b)
    TensorBoardLogger(tmp_path, trainer=engine, batch_size=8).attach(engine)
    engine.run([1, 2, 3], max_epochs=1)
    scalars = read_scalars(tmp_path)
    assert scalars["train/samples_per_second"][0][1] * scalars["train/epoch_time_s"][0][1] == pytest.approx(
        24, rel=1e-5
    )


def test_a_failed_run_closes_the_file(tmp_path):
    def step(engine: Engine, batch: Any) -> torch.Tensor:
        if engine.state.iteration == 5:
            raise ValueError("boom")
        return torch.tensor(1.0)

    engine = Engine(step)
    logger = TensorBoardLogger(tmp_path, trainer=engine)
    logger.attach(engine)
    with pytest.raises(ValueError, match="boom"):
        engine.run([1, 2, 3], max_epochs=3)
    assert logger._writer is None
    assert _steps(read_scalars(tmp_path)["train/epoch_time_s"]) == [3]


def test_nothing_written_means_no_folder(tmp_path):
    engine = Engine(lambda e, b: b)
    TensorBoardLogger(tmp_path / "tb", trainer=engine, log_every=None).attach(engine)
    engine.run([1, 2], max_iters=1, epoch_length=2)  # stops before any epoch's end
    assert not (tmp_path / "tb").exists()


def test_attach_to_another_engine_is_refused(tmp_path):
    trainer, other = Engine(lambda e, b: b), Engine(lambda e, b: b)
    with pytest.raises(ValueError, match="evaluators="):
        TensorBoardLogger(tmp_path, trainer=trainer).attach(other)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"log_every": 0}, ValueError, "log_every=0"),
        ({"log_every": True}, ValueError, "log_every=True"),
        ({"batch_size": -1}, ValueError, "batch_size=-1"),
        ({"evaluators": {"": None}}, ValueError, "tag prefix"),
        ({"evaluators": {"train": None}}, ValueError, "not 'train'"),
        ({"evaluators": {"val": object()}}, TypeError, "needs an Engine"),
        ({"trainer": object()}, TypeError, "trainer=..."),
    ],
)
def test_arguments_are_checked(tmp_path, kwargs, error, match):
    arguments: dict[str, Any] = {"trainer": Engine(lambda e, b: b), **kwargs}
    with pytest.raises(error, match=match):
        TensorBoardLogger(tmp_path, **arguments)


def tensorboard_worker(log_dir: str) -> dict[str, Any]:
    """Every rank builds and attaches the logger on the same folder; counts its writers."""
    import tensorboardX

    opened: list[str] = []
    original = tensorboardX.SummaryWriter

    class CountingWriter(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened.append(str(args[0]))
            super().__init__(*args, **kwargs)

    tensorboardX.SummaryWriter = CountingWriter
    try:
        seen = _run(Path(log_dir), scale=1.0 + get_rank(), log_every=2)
    finally:
        tensorboardX.SummaryWriter = original
    return {"rank": get_rank(), "opened": opened, "loss": seen["loss"], "val": seen["val"]}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_only_rank_zero_writes(tmp_path):
    log_dir = tmp_path / "tb"
    zero, one = run_distributed(tensorboard_worker, str(log_dir), nproc=2, timeout=45)
    assert zero["opened"] == [str(log_dir)] and one["opened"] == []
    assert len(event_files(log_dir)) == 1
    assert [p.name for p in log_dir.iterdir()] == [event_files(log_dir)[0].name]
    scalars = read_scalars(log_dir)
    assert zero["loss"] == one["loss"]  # agreed at the sync point
    assert _values(scalars["train/loss"]) == pytest.approx(zero["loss"], rel=1e-6)
    assert _values(scalars["val/mse"]) == pytest.approx([m["mse"] for m in zero["val"]], rel=1e-6)
    for (_, sps), (_, seconds) in zip(
        scalars["train/samples_per_second"], scalars["train/epoch_time_s"], strict=True
    ):
        assert sps * seconds == pytest.approx(ITERS * BATCH * 2, rel=1e-5)  # both ranks' samples


def test_a_trainer_run_twice_in_the_same_second_keeps_both_runs_scalars(tmp_path):
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    TensorBoardLogger(tmp_path, trainer=trainer).attach()
    trainer.run(DataLoader(_data(), batch_size=BATCH), max_epochs=1)
    trainer.run(DataLoader(_data(), batch_size=BATCH), max_epochs=2)  # continues: epoch 2
    assert len(list(Path(tmp_path).glob("events.out.tfevents.*"))) == 2  # one file per writer, none lost
    assert _steps(read_scalars(tmp_path)["train/loss"]) == [ITERS, 2 * ITERS]
