"""unison/recipe/planning/batch.py: a top-level ``criterion`` is called as QuantumGrav calls it,
``criterion(outputs, batch)``; one written the other way, ``criterion(y_pred, y)``, fails its first
call with an error that names the key, its file and line, the convention and how to write either."""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.config import ConfigError
from unison.recipe.phases import run

MODULE = """
import torch
from torch.utils.data import TensorDataset


def data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 3, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True)), TensorDataset(x[:4], x[:4].sum(1, keepdim=True))


def as_y_pred_y(y_pred, y):
    return torch.nn.functional.mse_loss(y_pred, y)


def as_outputs_batch(outputs, batch):
    return torch.nn.functional.mse_loss(outputs, batch[1])
"""

CONFIG = """name: crit
criterion: !pyobject crit_user.{criterion}
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 3, out_features: 1}}}}
data: {{build: !pyobject crit_user.data}}
training:
  max_epochs: 1
  batch_size: 4
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.01}}
validation: {{metrics: {{loss: !pyobject unison.metrics.Loss}}}}
logging: {{root: {root}, progress: false}}
"""


def _config(folder: Path, criterion: str) -> Path:
    (folder / "crit_user.py").write_text(MODULE)
    path = folder / "config.yaml"
    path.write_text(CONFIG.format(criterion=criterion, root=folder / "runs"))
    return path


def test_a_criterion_written_as_y_pred_y_fails_naming_the_key_and_the_convention(tmp_path: Path) -> None:
    path = _config(tmp_path, "as_y_pred_y")
    with pytest.raises(ConfigError) as info:
        run(path)
    message = str(info.value)
    assert info.value.key_path == "criterion" and f"{path}:2" in message, message
    assert "criterion(outputs, batch)" in message and "training.loss" in message, message
    assert str(info.value.__cause__) in message, message  # what torch said, kept


def test_a_criterion_of_outputs_and_batch_trains(tmp_path: Path) -> None:
    results = run(_config(tmp_path, "as_outputs_batch"))
    assert results["iterations"] == 3 and results["validation"]["loss"] > 0
