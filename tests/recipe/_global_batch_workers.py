"""Configs with a global batch size, the user module they name, and the rank function of
tests/recipe/test_global_batch.py: a run planned and built from a config file on each rank.

``run_distributed`` sends :func:`trained` by name; the ranks import this module, not the test.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Events

from unison.config import load_config
from unison.distributed import get_world_size, unwrap_model
from unison.recipe.build.assemble import build_run
from unison.recipe.planning.run_plan import plan

USER_MODULE = """
import torch
from torch.utils.data import TensorDataset


def build(seed):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(18, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:12], y[:12]), TensorDataset(x[12:], y[12:])


def build_for(seed, world_size):
    train, val = build(seed)
    train.world_size = world_size  # what the run told the builder
    return train, val
"""

CONFIG = """\
name: global-batch
model:
  type: !pyobject torch.nn.Linear
  kwargs: {{in_features: 4, out_features: 2}}
data:
  build: !pyobject batch_data.{build}
training:
{batch}
  accumulation_steps: {accumulation}
  max_epochs: 2
  optimizer_type: !pyobject torch.optim.SGD
  lr: 0.5
logging: {{progress: false, tensorboard: false, root: {root}}}
checkpoint: {{enabled: false, preemption: false}}
"""


def write_config(folder: Path, batch: str, accumulation: int = 1, build: str = "build") -> Path:
    """A config in ``folder`` (``batch``: its batch key, as a line of the training section) and
    the user module beside it; returns the config's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "batch_data.py").write_text(USER_MODULE)
    path = folder / "config.yaml"
    path.write_text(
        CONFIG.format(batch=f"  {batch}", accumulation=accumulation, build=build, root=folder / "runs")
    )
    return path


def trained(config_paths: list[str]) -> list[dict[str, Any]]:
    """Each config planned, built and trained on this rank: the batches of every iteration (their
    inputs, by value), the trained weights, the loader's batch size, what ``data.build`` was told."""
    out = []
    for path in config_paths:
        planned = plan(load_config(path))
        with tempfile.TemporaryDirectory() as run_dir:
            parts = build_run(planned, Path(run_dir), get_world_size())
            seen: list[list[list[float]]] = []
            parts.trainer.add_event_handler(
                Events.ITERATION_COMPLETED, lambda e, seen=seen: seen.append(e.state.batch[0].tolist())
            )
            parts.trainer.run(parts.train_loader, max_epochs=2)
        weights = torch.cat([p.detach().reshape(-1) for p in unwrap_model(parts.model).parameters()])
        out.append(
            {
                "batches": seen,
                "weights": weights,
                "batch_size": parts.train_loader.batch_size,
                "told": getattr(parts.datasets.train, "world_size", None),
            }
        )
    return out
