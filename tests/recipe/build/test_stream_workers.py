"""training.num_workers with a stream that does not split by worker: refused at the config's key
(unison/recipe/build/stream_workers.py), not as prepare_loaders' argument."""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.config import ConfigError, load_config
from unison.recipe import plan
from unison.recipe.build.assemble import build_loaders
from unison.recipe.build.parts import Datasets

DATA = """\
import torch
from torch.utils.data import IterableDataset, TensorDataset


class Items(IterableDataset):
    def __iter__(self):
        for i in range(8):
            yield torch.full((4,), float(i)), i % 2


def build(seed):
    x = torch.zeros(4, 4)
    return Items(), TensorDataset(x, torch.zeros(4, dtype=torch.long))
"""

BODY = """\
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject workerdata.build
training:
  batch_size: 4
  num_workers: 2
"""


def test_num_workers_from_a_config_is_refused_at_its_key_for_a_stream_without_worker_split(
    tmp_path: Path,
) -> None:
    (tmp_path / "workerdata.py").write_text(DATA)
    config = tmp_path / "config.yaml"
    config.write_text(BODY)
    planned = plan(load_config(config))
    with pytest.raises(ConfigError) as err:
        build_loaders(planned, Datasets(*planned.resolved.data_build(seed=0)))  # one rank: sharded by rank
    message = str(err.value)
    assert message.startswith(
        f"{config}:8: training.num_workers: 2, and the training stream, workerdata.Items"
    )
    assert "prepare_loaders" not in message and "training.num_workers: 0" in message
