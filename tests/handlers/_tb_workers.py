"""Rank functions of the profiler tests (tests/handlers/test_profiler.py).

:func:`train` runs a small DDP model for a few epochs, with or without a
:class:`~unison.handlers.profiler.Profiler`, and returns what the test compares: the
final training loss, the weights, and the handlers left on ``ITERATION_COMPLETED``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from unison.distributed import get_rank, prepare_loaders, prepare_model, unwrap_model
from unison.engine import Events, create_trainer
from unison.handlers.profiler import Profiler
from unison.utils import manual_seed

EPOCHS, BATCH = 3, 4


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long())


def train(log_dir: str | None, window: dict[str, int] | None = None) -> dict[str, Any]:
    """Trains on every rank; with ``log_dir``, profiles the ``window`` into it."""
    manual_seed(0)
    model = prepare_model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(model, optimizer, F.cross_entropy)
    loader, _ = prepare_loaders(_data(), None, batch_size=BATCH, seed=0)
    profiler = None
    if log_dir is not None:
        profiler = Profiler(Path(log_dir), **(window or {}))
        profiler.attach(trainer)
    trainer.run(loader, max_epochs=EPOCHS)
    return {
        "rank": get_rank(),
        "loss": trainer.state.metrics["loss"],
        "iterations": trainer.state.iteration,
        "weights": {k: v.clone() for k, v in unwrap_model(model).state_dict().items()},
        "per_iteration": len(trainer._event_handlers[Events.ITERATION_COMPLETED]),
        "folder": None if profiler is None or profiler.folder is None else str(profiler.folder),
        "running": None if profiler is None else profiler.running,
    }
