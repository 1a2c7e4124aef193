"""A tiny classifier run for the tests of unison/cli/: what ``resolve`` returns, a quiet config.

Shared by tests/recipe/build/test_assemble.py and tests/cli/test_run.py, which build and train it in
one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from unison.config import Config
from unison.metrics import Accuracy, Loss
from unison.recipe.build.assemble import build_run
from unison.recipe.build.parts import Datasets, RunParts
from unison.recipe.planning.resolved import Resolved
from unison.recipe.planning.run_plan import RunPlan, plan


def tiny_datasets(seed: int, n: int = 24, test: bool = True) -> tuple[TensorDataset, ...]:
    """Two classes of 4 features: (train, val, test), or (train, val) without ``test``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    sets = (TensorDataset(x[:12], y[:12]), TensorDataset(x[12:18], y[12:18]), TensorDataset(x[18:], y[18:]))
    return sets if test else sets[:2]


def resolved(**changes: Any) -> Resolved:
    """What ``resolve`` returns for a small classifier, without a config file."""
    fields: dict[str, Any] = dict(
        optimizer_type=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1},
        scheduler_type=None,
        scheduler_kwargs={},
        loss=F.cross_entropy,
        model_type=nn.Linear,
        model_kwargs={"in_features": 4, "out_features": 2},
        data_build=tiny_datasets,
        data_kwargs={},
        metrics={"accuracy": (Accuracy, {}), "loss": (Loss, {})},
        after_training=None,
    )
    fields.update(changes)
    return Resolved(**fields)


def config(tmp_path: Path | None = None) -> Config:
    """A quiet config: one short epoch, no progress bar, no TensorBoard, no signal handlers."""
    c = Config()
    c.training.max_epochs = 1
    c.training.batch_size = 4
    c.logging.progress = False
    c.logging.tensorboard = False
    c.checkpoint.preemption = False
    c.checkpoint.enabled = tmp_path is not None
    return c


def datasets() -> Datasets:
    return Datasets(*tiny_datasets(0))


def planned(c: Config, r: Resolved | None = None) -> RunPlan:
    """The plan of ``c`` with what ``resolve`` returns for the small classifier (or ``r``)."""
    return plan(c, r if r is not None else resolved())


def parts_of(c: Config, r: Resolved, run_dir: Path) -> RunParts:
    """Every build step, in order, at world size 1."""
    return build_run(plan(c, r), run_dir, world_size=1)
