"""One check for every tracker's section (``logging.mlflow``, ``logging.wandb``) before spawning:
installed, names not empty, ``every`` at sync points, each refused at its key's file:line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from unison.config import ConfigError, load_config
from unison.recipe.planning.tracking_store import check_tracker

CONFIG = """\
name: tiny
model: {type: !pyobject torch.nn.Linear, kwargs: {in_features: 4, out_features: 2}}
data: {build: !pyobject torch.utils.data.TensorDataset}
training:
  batch_size: 8
  optimizer_type: !pyobject torch.optim.SGD
  lr: 0.1
logging:
  mlflow:
    experiment: tiny
  wandb:
    project: tiny
"""
TRACKERS = {"mlflow": ("experiment", "run_name"), "wandb": ("project", "name")}


def _check(path: Path, name: str, *overrides: str) -> object:
    return check_tracker(load_config(path, list(overrides)), name, name, f"{name} is missing", TRACKERS[name])


@pytest.fixture
def path(tmp_path: Path) -> Path:
    written = tmp_path / "config.yaml"
    written.write_text(CONFIG)
    return written


@pytest.mark.parametrize("name", sorted(TRACKERS))
def test_each_trackers_section_is_checked_by_the_same_rules_at_its_keys_line(
    name: str, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = path.read_text().splitlines()
    assert _check(path, name) is not None
    assert _check(path, name, f"logging.{name}=null") is None  # off: nothing to check
    with pytest.raises(ConfigError, match="training.sync_every") as info:
        _check(path, name, f"logging.{name}.every=10", "training.sync_every=null")
    assert info.value.key_path == f"logging.{name}.every"
    field = TRACKERS[name][0]
    with pytest.raises(ConfigError, match=f"{field} is empty") as info:
        _check(path, name, f"logging.{name}.{field}=' '")
    assert info.value.key_path == f"logging.{name}.{field}"
    monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    with pytest.raises(ConfigError, match=f"logging.{name} is set, but {name} is missing, or remove") as info:
        _check(path, name)
    assert (info.value.key_path, info.value.line) == (f"logging.{name}", lines.index(f"  {name}:") + 1)
