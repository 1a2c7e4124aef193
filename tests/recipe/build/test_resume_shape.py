"""unison/recipe/build/resume_shape.py: a resume the saved checkpoint cannot continue is refused before any
rank starts, naming the key: OneCycleLR stepped per update at another world size (its total_steps
count another number of updates an epoch), another training.num_workers on a stream saved mid-epoch."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

import unison.recipe.phases as runner
from unison.config import ConfigError, load_config
from unison.recipe.phases import run, train_from_config
from unison.testing import run_distributed

READER = """\
import os

import torch


def read(path):
    for line in path.read_text().split():
        x, y = line.split(",")
        if int(x) == 7 and not os.path.exists(os.path.join(os.path.dirname(__file__), "failed")):
            open(os.path.join(os.path.dirname(__file__), "failed"), "w").close()
            raise RuntimeError("the first run ends here, after its mid-epoch save")
        yield torch.tensor([float(x)]), int(y)
"""

STREAM_CONFIG = """\
name: streamed
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 1, out_features: 2}}}}
data:
  stream:
    files: [shards/train-*.txt]
    val_files: [shards/val.txt]
    reader: !pyobject {module}.read
training:
  max_epochs: 1
  batch_size: 2
  num_workers: {workers}
  path: {root}
checkpoint: {{every_iters: 2, preemption: false}}
logging: {{progress: false, tensorboard: false}}
"""


@pytest.fixture
def module(tmp_path: Path, monkeypatch) -> Any:
    name = f"shape_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def _stream_config(folder: Path, module: str, workers: int) -> Path:
    (folder / f"{module}.py").write_text(READER)
    shards = folder / "shards"
    shards.mkdir(exist_ok=True)
    for f in range(2):
        (shards / f"train-{f}.txt").write_text("\n".join(f"{f * 8 + i},{i % 2}" for i in range(8)))
    (shards / "val.txt").write_text("-1,0\n-2,1")
    path = folder / f"config-{workers}.yaml"
    path.write_text(STREAM_CONFIG.format(module=module, workers=workers, root=folder / "runs"))
    return path


def test_other_loader_workers_on_a_stream_saved_mid_epoch_are_refused_before_any_rank(
    tmp_path: Path, module: str, monkeypatch
) -> None:
    with pytest.raises(Exception, match="the first run ends here"):
        train_from_config(load_config(_stream_config(tmp_path, module, workers=0)))
    started: list[Any] = []
    monkeypatch.setattr(runner, "launch_config", lambda *a, **k: started.append(a) or [{}])
    path = _stream_config(tmp_path, module, workers=1)
    with pytest.raises(ConfigError) as info:
        run(path, resume="auto")
    message = str(info.value)
    assert info.value.key_path == "training.num_workers" and f"{path}:" in message, message
    assert "0 -> 1" in message and "mid-epoch" in message, message
    assert started == []


ONE_CYCLE_CONFIG = """\
name: cycled
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 4, out_features: 2}}}}
data: {{build: !pyobject {module}.build}}
training:
  max_epochs: {epochs}
  batch_size: 4
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.1}}
  scheduler_type: !pyobject torch.optim.lr_scheduler.OneCycleLR
  scheduler_kwargs: {{max_lr: 0.1, total_steps: 4}}
  scheduler_every: update
  path: {root}
validation: {{metrics: {{accuracy: !pyobject unison.metrics.Accuracy}}}}
checkpoint: {{preemption: false}}
logging: {{progress: false, tensorboard: false}}
"""

DATA = """\
import torch
from torch.utils.data import TensorDataset


def build(seed):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
    return ds, ds
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_onecycle_stepped_per_update_at_another_world_size_is_refused_before_any_rank(
    tmp_path: Path, module: str, monkeypatch
) -> None:
    """2 ranks x 2 updates an epoch: total_steps 4 is two epochs. At 1 rank an epoch takes 4 updates,
    and OneCycleLR would fail in the second epoch ("Tried to step 5 times")."""
    from _resume_shape_workers import train

    (tmp_path / f"{module}.py").write_text(DATA)
    first = tmp_path / "first.yaml"
    first.write_text(ONE_CYCLE_CONFIG.format(module=module, epochs=1, root=tmp_path / "runs"))
    (result, _) = run_distributed(train, str(first), nproc=2, timeout=120)
    assert (result["world_size"], result["iterations"]) == (2, 2)
    started: list[Any] = []
    monkeypatch.setattr(runner, "launch_config", lambda *a, **k: started.append(a) or [{}])
    path = tmp_path / "more.yaml"
    path.write_text(ONE_CYCLE_CONFIG.format(module=module, epochs=2, root=tmp_path / "runs"))
    with pytest.raises(ConfigError) as info:
        run(path, nproc=1, resume="auto")
    message = str(info.value)
    assert info.value.key_path == "training.scheduler_kwargs.total_steps" and f"{path}:" in message, message
    assert "saved at 2 ranks and this run has 1" in message and "Resume at 2 ranks" in message, message
    assert started == []
    run(path, nproc=2, resume="auto")  # at the saved world size it goes ahead
    assert len(started) == 1


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_onecycle_stepped_per_update_resumes_at_another_world_size_with_a_global_batch(
    tmp_path: Path, module: str
) -> None:
    """training.global_batch_size: 8 over 16 samples is 2 updates an epoch at 1 rank and at 2, so
    total_steps 4 is two epochs at either: trained one epoch at 2 ranks, the run resumes at 1 and
    ends its schedule on its last step."""
    from _resume_shape_workers import train

    (tmp_path / f"{module}.py").write_text(DATA)
    text = ONE_CYCLE_CONFIG.replace("  batch_size: 4\n", "  global_batch_size: 8\n")
    first = tmp_path / "first.yaml"
    first.write_text(text.format(module=module, epochs=1, root=tmp_path / "runs"))
    (result, _) = run_distributed(train, str(first), nproc=2, timeout=120)
    assert (result["world_size"], result["iterations"]) == (2, 2)
    path = tmp_path / "more.yaml"
    path.write_text(text.format(module=module, epochs=2, root=tmp_path / "runs"))
    resumed = run(path, resume="auto")  # one process: 8 samples a step, 2 updates, steps 3 and 4
    assert (resumed["world_size"], resumed["epochs"], resumed["iterations"]) == (1, 2, 4)
