"""A tiny training run with an MLflowLogger, on one rank or on every rank of run_distributed.

Each rank trains its own Linear model on its own data (so the ranks' losses differ) and
returns what its engines saw: every iteration's loss, each epoch's agreed loss and
validation value, and whether this process ever imported MLflow.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from unison.distributed import get_rank, get_world_size
from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers.mlflow import MLflowLogger
from unison.metrics import MeanSquaredError

N_SAMPLES, BATCH = 24, 4
ITERS = N_SAMPLES // BATCH  # per epoch


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(N_SAMPLES, 3, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, N_SAMPLES, BATCH)]


def train(
    uri: str,
    experiment: str,
    *,
    folder: str | None = None,
    epochs: int = 2,
    sync_every: int | None = None,
    fail_at: int | None = None,
    stop_at: int | None = None,
    **logger_kwargs: Any,
) -> dict[str, Any]:
    """Trains ``epochs`` epochs with an MLflowLogger attached; returns what the engines saw.

    ``fail_at``: a handler raises at that iteration. ``stop_at``: the trainer is stopped there
    as preemption stops it (no ``COMPLETED`` follows).
    """
    rank = get_rank()
    data = batches(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, F.mse_loss, sync_every=sync_every)
    evaluator = create_evaluator(model, {"mse": MeanSquaredError()})
    seen: dict[str, Any] = {"losses": [], "epoch_loss": [], "val": [], "epoch_end": []}
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen["losses"].append(float(e.state.output))
    )

    def validate(engine: Engine) -> None:
        evaluator.run(data[:2])
        seen["epoch_loss"].append(engine.state.metrics["loss"])
        seen["val"].append(evaluator.state.metrics["mse"])
        seen["epoch_end"].append(engine.state.iteration)

    trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)
    if folder is not None:
        logger_kwargs.setdefault("artifact_location", (Path(folder) / "mlartifacts").as_uri())
    logger = MLflowLogger(
        uri, trainer=trainer, evaluators={"val": evaluator}, experiment=experiment, **logger_kwargs
    )
    logger.attach(trainer)
    if fail_at is not None:

        def fail(engine: Engine) -> None:
            raise RuntimeError("a failing step")

        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=fail_at), fail)
    if stop_at is not None:
        trainer.add_event_handler(
            Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate(skip_completed=True)
        )
    try:
        trainer.run(data, max_epochs=epochs)
    except RuntimeError as err:
        seen["error"] = str(err)
    seen.update(
        rank=rank, world_size=get_world_size(), run_id=logger.run_id, imported="mlflow" in sys.modules
    )
    return seen
