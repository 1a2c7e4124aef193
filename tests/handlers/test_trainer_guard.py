"""A handler built for a trainer refuses another engine at attach, naming it, its trainer and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from unison.engine import Engine
from unison.handlers.checkpoint import Checkpoint
from unison.handlers.hparams import HParamsLogger
from unison.handlers.mlflow import MLflowLogger
from unison.handlers.tensorboard import TensorBoardLogger
from unison.handlers.wandb import WandbLogger

BUILD = {
    "Checkpoint": lambda trainer, folder: Checkpoint(folder, {"model": nn.Linear(2, 1)}, trainer),
    "HParamsLogger": lambda trainer, folder: HParamsLogger(folder, {"lr": 0.1}, trainer=trainer),
    "TensorBoardLogger": lambda trainer, folder: TensorBoardLogger(folder, trainer=trainer),
    "MLflowLogger": lambda trainer, folder: MLflowLogger(
        f"sqlite:///{folder}/mlflow.db", trainer=trainer, experiment="e"
    ),
    "WandbLogger": lambda trainer, folder: WandbLogger("p", trainer=trainer, mode="disabled"),
}
WITH_EVALUATORS = {"TensorBoardLogger", "MLflowLogger", "WandbLogger"}


@pytest.mark.parametrize("who", sorted(BUILD))
def test_a_handler_attached_to_another_engine_than_its_trainer_is_refused_by_name(
    who: str, tmp_path: Path
) -> None:
    trainer = Engine(lambda e, b: b, name="trainer")
    evaluator = Engine(lambda e, b: b, name="evaluator")
    handler = BUILD[who](trainer, tmp_path)
    with pytest.raises(ValueError) as info:
        handler.attach(evaluator)
    message = str(info.value)
    assert message.startswith(
        f"{who}.attach(engine) got the engine 'evaluator', not its trainer (the engine 'trainer')"
    )
    assert f"attach it to the trainer given as {who}(trainer=...)" in message
    assert ("evaluators go to the constructor" in message) == (who in WITH_EVALUATORS)
    handler.attach(trainer)  # its own trainer: taken
    handler.attach()  # the default: its trainer
