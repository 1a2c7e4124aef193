"""checkpoint.every_seconds from a config: checked at its line, reaching the Checkpoint
handler the recipe attaches, and refused with a stream that cannot tell its position."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader, IterableDataset

from unison.config import ConfigError, load_config
from unison.recipe import plan
from unison.recipe.build.assemble import build_run
from unison.recipe.build.stream_data import check_mid_epoch_saves

DATA = """\
import torch
from torch.utils.data import TensorDataset


def build(seed):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    y = (x[:, 0] > 0).long()
    return TensorDataset(x, y), TensorDataset(x[:8], y[:8])
"""

BODY = """\
name: timed
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject timeddata.build
training:
  max_epochs: 1
  batch_size: 4
  amp: none
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
"""


class Plain(IterableDataset):
    """A stream that says nothing of its position."""

    def __iter__(self):  # noqa: ANN204
        yield from range(4)


def _config(tmp_path: Path, checkpoint: str) -> Path:
    (tmp_path / "timeddata.py").write_text(DATA)
    path = tmp_path / "config.yaml"
    path.write_text(BODY + "checkpoint:\n" + checkpoint)
    return path


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_every_seconds_reaches_the_checkpoint_handler_on_the_trainers_sync_point(tmp_path: Path) -> None:
    planned = plan(load_config(_config(tmp_path, "  every_seconds: 90\n")))
    assert planned.checkpoint is not None and planned.checkpoint.every_seconds == 90
    parts = build_run(planned, tmp_path / "run", world_size=1)
    checkpoint = parts.checkpoint
    assert checkpoint is not None and checkpoint.every_seconds == 90
    assert checkpoint.timed is not None and checkpoint.timed.seconds == 90.0
    assert any(c is checkpoint.timed for c in parts.trainer.sync_point.contributors(epoch_end=False))
    checkpoint.lock.release()

    unset = plan(load_config(_config(tmp_path, "  every_iters: 5\n")))
    assert unset.checkpoint is not None and unset.checkpoint.every_seconds is None


@pytest.mark.parametrize("value", ["0", "-30"])
def test_a_non_positive_every_seconds_is_refused_at_its_line(tmp_path: Path, value: str) -> None:
    path = _config(tmp_path, f"  every_seconds: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{_line(path, 'every_seconds')}: checkpoint.every_seconds:"), message
    assert "must be > 0" in message and value in message


def test_every_seconds_with_a_positionless_stream_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = _config(tmp_path, "  every_seconds: 600\n  preemption: false\n")
    with pytest.raises(ConfigError) as err:
        check_mid_epoch_saves(plan(load_config(path)), DataLoader(Plain(), batch_size=2))
    message = str(err.value)
    line = _line(path, "every_seconds")
    assert message.startswith(f"{path}:{line}: checkpoint.every_seconds:"), message
    assert f"checkpoint.every_seconds: 600 ({path}:{line})" in message
    assert "checkpoint.every_seconds unset" in message and "Plain" in message
