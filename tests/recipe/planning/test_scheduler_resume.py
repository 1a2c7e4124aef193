"""unison/recipe/planning/scheduler_resume.py: a changed training.scheduler_kwargs on resume is applied on the
loaded scheduler (and the record says how), or refused before any rank starts; never reported as a
change the checkpoint's saved scheduler state then undoes."""

from __future__ import annotations

import json
import logging
import math
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing

import unison.distributed.launcher as launcher
from unison.config import ConfigError, load_config
from unison.recipe.phases import run, train_from_config
from unison.recipe.planning.changes import CHANGES_FILE

DATA_MODULE = """\
import torch
from torch.utils.data import TensorDataset


def build(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return ds, ds
"""

CONFIG = """\
name: sched
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 4, out_features: 2}}}}
data: {{build: !pyobject {module}.build}}
training:
  max_epochs: {epochs}
  batch_size: 4
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.1}}
  scheduler_type: !pyobject torch.optim.lr_scheduler.{scheduler}
  scheduler_kwargs: {kwargs}
  scheduler_every: {every}
  path: {root}
validation: {{metrics: {{accuracy: !pyobject unison.metrics.Accuracy}}}}
logging: {{progress: false, tensorboard: false}}
checkpoint: {{preemption: false}}
"""


@pytest.fixture
def write(tmp_path: Path, monkeypatch):
    module = f"sched_cfg_{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / f"{module}.py").write_text(DATA_MODULE)

    def config(scheduler: str, kwargs: str, epochs: int, every: str = "epoch") -> Path:
        path = tmp_path / f"config-{uuid.uuid4().hex[:6]}.yaml"
        text = CONFIG.format(
            module=module,
            scheduler=scheduler,
            kwargs=kwargs,
            epochs=epochs,
            every=every,
            root=tmp_path / "runs",
        )
        path.write_text(text)
        return path

    yield config
    sys.modules.pop(module, None)


def _trained(path: Path, resume: str | None = None) -> tuple[dict[str, Any], list[float]]:
    """The run's results and the learning rate of every optimizer step it took."""
    used: list[float] = []

    def record(parts: Any) -> None:
        parts.optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))

    return train_from_config(load_config(path), resume=resume, attach=record), used


def _close(values: list[float], expected: list[float]) -> bool:
    return len(values) == len(expected) and all(
        math.isclose(v, e, rel_tol=1e-9) for v, e in zip(values, expected, strict=True)
    )


def test_a_changed_steplr_gamma_is_applied_and_recorded_as_applied(write, caplog) -> None:
    first, _ = _trained(write("StepLR", "{step_size: 1, gamma: 0.5}", epochs=1))
    caplog.set_level(logging.INFO, logger="unison")
    again, used = _trained(write("StepLR", "{step_size: 1, gamma: 0.1}", epochs=3), resume="auto")
    assert again["run_dir"] == first["run_dir"]
    # epoch 2 at the saved 0.05; epoch 3 at 0.05 x the new gamma 0.1 (not x the saved 0.5: 0.025)
    assert _close(used, [0.05] * 4 + [0.005] * 4), used
    assert "changed on resume: training.scheduler_kwargs.gamma 0.5 -> 0.1 (applied: " in caplog.text
    (line,) = (Path(first["run_dir"]) / CHANGES_FILE).read_text().splitlines()
    recorded = {c["key"]: c for c in json.loads(line)["changes"]}
    assert "StepLR" in recorded["training.scheduler_kwargs.gamma"]["applied"]


def test_a_changed_onecycle_max_lr_continues_the_new_schedule(write) -> None:
    kwargs = "{{max_lr: {}, total_steps: 12}}"
    _trained(write("OneCycleLR", kwargs.format(0.1), epochs=1, every="update"))
    _, used = _trained(write("OneCycleLR", kwargs.format(0.4), epochs=3, every="update"), resume="auto")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    truth = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.4, total_steps=12)
    schedule = []
    for _ in range(12):
        schedule.append(opt.param_groups[0]["lr"])
        opt.step()
        truth.step()
    assert _close(used, schedule[4:]), (used, schedule)  # the schedule of max_lr 0.4 from step 5 on


def test_a_change_of_the_schedules_shape_is_refused_before_any_rank_starts(write, monkeypatch) -> None:
    _trained(write("OneCycleLR", "{max_lr: 0.1, total_steps: 12}", epochs=1, every="update"))
    spawned: list[str] = []
    monkeypatch.setattr(launcher, "_spawn", lambda *a, **k: spawned.append("spawn"))
    monkeypatch.setattr(torch.multiprocessing, "start_processes", lambda *a, **k: spawned.append("start"))
    path = write("OneCycleLR", "{max_lr: 0.1, total_steps: 24}", epochs=2, every="update")
    with pytest.raises(ConfigError) as info:
        run(path, nproc=2, resume="auto")
    message = str(info.value)
    assert info.value.key_path == "training.scheduler_kwargs.total_steps", message
    assert "12 -> 24" in message and "OneCycleLR" in message and "start a new run" in message, message
    assert spawned == []
