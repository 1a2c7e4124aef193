"""unison/recipe/build/resume_values.py: on resume, the optimizer's values the config derives or changed win.

The truth is the lr every update used (read at the step) and what the log says: after a
world-size change under ``lr_scaling: linear`` the run trains at the new scaled rate, and
after ``--set training.lr=`` at the new one, with a step schedule continuing from the new base.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _resume_lr_workers import trained_lrs

from unison.testing import run_distributed

CONFIG = """\
name: rebased
model:
  type: !pyobject torch.nn.Linear
  kwargs: {{in_features: 4, out_features: 2}}
data:
  build: !pyobject rebased_data.build
training:
  max_epochs: 1
  batch_size: 2
  lr_scaling: linear
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.1, momentum: 0.5}}
  scheduler_type: !pyobject torch.optim.lr_scheduler.StepLR
  scheduler_kwargs: {{step_size: 1, gamma: 0.5}}
  path: {root}
validation:
  metrics:
    accuracy: !pyobject unison.metrics.Accuracy
logging: {{progress: false, tensorboard: false}}
checkpoint: {{preemption: false}}
"""


DATA_MODULE = """\
import torch
from torch.utils.data import TensorDataset


def build(seed):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(12, 4, generator=g), torch.randint(0, 2, (12,), generator=g))
    return ds, ds
"""


def _close(values: list[float], expected: float) -> bool:
    return bool(values) and all(math.isclose(v, expected, rel_tol=1e-9) for v in values)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_world_size_change_and_a_new_lr_are_trained_as_logged(tmp_path: Path) -> None:
    (tmp_path / "rebased_data.py").write_text(DATA_MODULE)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path / "runs"))
    first = run_distributed(trained_lrs, str(config), None, [], nproc=2, timeout=120)[0]
    assert _close(first["used"], 0.2), first["used"]  # 0.1 x 2 ranks; StepLR halves it after epoch 1

    run_dir = first["run_dir"]
    grown = run_distributed(
        trained_lrs, str(config), run_dir, ["training.max_epochs=2"], nproc=3, timeout=120
    )[0]
    assert _close(grown["used"], 0.15), grown["used"]  # the schedule's 0.5 of the new base 0.3
    assert (
        "learning rate on resume: 0.1 -> 0.15 (this config's base 0.3 at 3 ranks; the checkpoint's 0.2 at 2 ranks)"
        in grown["log"]
    )

    changed = ["training.max_epochs=3", "training.lr=0.01", "training.optimizer_kwargs.momentum=0.0"]
    again = run_distributed(trained_lrs, str(config), run_dir, changed, nproc=3, timeout=120)[0]
    assert _close(again["used"], 0.0075), again["used"]  # 0.25 of the new base 0.03
    assert any(line.startswith("learning rate on resume: 0.075 -> 0.0075") for line in again["log"]), again[
        "log"
    ]
    assert "optimizer momentum on resume: 0.0 (changed from 0.5)" in again["log"]


def test_schedulers_that_set_the_lr_get_their_lr_arguments_scaled() -> None:
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR, StepLR

    from unison.config import Config
    from unison.recipe.planning.lr_plan import lr_plan, scaled_scheduler_kwargs

    c = Config()
    c.training.lr_scaling = "linear"
    one_cycle = scaled_scheduler_kwargs(lr_plan(c, 3), OneCycleLR, {"max_lr": 0.1, "total_steps": 10})
    assert one_cycle["max_lr"] == pytest.approx(0.3) and one_cycle["total_steps"] == 10
    cyclic = scaled_scheduler_kwargs(lr_plan(c, 2), CyclicLR, {"base_lr": 0.01, "max_lr": [0.1]})
    assert cyclic["base_lr"] == pytest.approx(0.02) and cyclic["max_lr"] == [pytest.approx(0.2)]
    assert scaled_scheduler_kwargs(lr_plan(c, 2), StepLR, {"step_size": 1}) == {"step_size": 1}
    c.training.lr_scaling = "none"
    assert scaled_scheduler_kwargs(lr_plan(c, 3), OneCycleLR, {"max_lr": 0.1}) == {"max_lr": 0.1}
