"""A resumed run compares its config with the saved one: changes are applied and recorded,
or refused before any rank is spawned."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path

import pytest
import torch.multiprocessing

import unison.distributed.launcher as launcher
from unison.config import Config, ConfigError, load_config
from unison.recipe.phases import run, train_from_config
from unison.recipe.planning.changes import CHANGES_FILE, config_changes

DATA_MODULE = """\
import torch
from torch.utils.data import TensorDataset


def build(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return ds, ds
"""

CONFIG = """\
name: resumed
model:
  type: !pyobject torch.nn.Linear
  kwargs: {{in_features: 4, out_features: {out}}}
data:
  build: !pyobject {module}.build
training:
  max_epochs: {epochs}
  batch_size: 4
  optimizer_kwargs: {{lr: {lr}}}
  path: {root}
validation:
  metrics:
    accuracy: !pyobject unison.metrics.Accuracy
logging: {{progress: false, tensorboard: false}}
checkpoint: {{preemption: false}}
"""


@pytest.fixture
def write(tmp_path: Path, monkeypatch):
    module = f"resume_cfg_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / f"{module}.py").write_text(DATA_MODULE)

    def config(out: int = 2, lr: float = 0.003, epochs: int = 1) -> Path:
        path = tmp_path / f"config-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(CONFIG.format(out=out, lr=lr, epochs=epochs, module=module, root=tmp_path / "runs"))
        return path

    yield config
    sys.modules.pop(module, None)


def test_changes_are_listed_by_key_with_both_values() -> None:
    old, new = Config(), Config()
    new.training.optimizer_kwargs = {"lr": 0.01}
    old.training.optimizer_kwargs = {"lr": 0.003}
    assert [str(c) for c in config_changes(old, new)] == ["training.optimizer_kwargs.lr 0.003 -> 0.01"]


def test_a_learning_rate_change_resumes_is_logged_and_recorded(write, caplog) -> None:
    first = train_from_config(load_config(write(epochs=1)))
    caplog.set_level(logging.WARNING, logger="unison")
    again = train_from_config(load_config(write(lr=0.01, epochs=2)), resume="auto")
    assert again["run_dir"] == first["run_dir"] and again["epochs"] == 2
    assert "changed on resume: training.optimizer_kwargs.lr 0.003 -> 0.01" in caplog.text
    assert "changed on resume: training.max_epochs 1 -> 2" in caplog.text
    (line,) = (Path(first["run_dir"]) / CHANGES_FILE).read_text().splitlines()
    recorded = {c["key"]: (c["old"], c["new"]) for c in json.loads(line)["changes"]}
    assert recorded["training.optimizer_kwargs.lr"] == (0.003, 0.01)


def test_a_model_shape_change_is_refused_before_any_rank_starts(write, monkeypatch) -> None:
    train_from_config(load_config(write()))
    spawned: list[str] = []
    monkeypatch.setattr(launcher, "_spawn", lambda *a, **k: spawned.append("spawn"))
    monkeypatch.setattr(torch.multiprocessing, "start_processes", lambda *a, **k: spawned.append("start"))
    with pytest.raises(ConfigError) as info:
        run(write(out=3), nproc=2, resume="auto")
    message = str(info.value)
    assert "model.kwargs.out_features 2 -> 3" in message and "cannot resume" in message
    assert ": model.kwargs.out_features: " in message  # the key path, where a ConfigError puts it
    assert spawned == []


def test_a_busy_master_port_is_refused_before_any_rank_starts(write, monkeypatch) -> None:
    import socket

    spawned: list[str] = []
    monkeypatch.setattr(launcher, "_spawn", lambda *a, **k: spawned.append("spawn"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"parallel.master_port: {port} is in use on 127.0.0.1"):
            run(write(), nproc=2, overrides=[f"parallel.master_port={port}"])
    assert spawned == []
