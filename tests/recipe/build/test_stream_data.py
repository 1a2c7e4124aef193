"""unison/recipe/build/stream_data.py: a stream from data.build meets training.shuffle, the ranks and
mid-epoch checkpoints in terms of the config: the key, its file and line, and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader, IterableDataset

from unison.config import ConfigError, load_config
from unison.distributed import prepare_loaders
from unison.recipe import plan
from unison.recipe.build.assemble import build_loaders
from unison.recipe.build.parts import Datasets
from unison.recipe.build.stream_data import check_mid_epoch_saves, check_stream_sharding, train_shuffle
from unison.recipe.planning.run_plan import RunPlan

DATA = """\
import torch
from torch.utils.data import IterableDataset, TensorDataset

from unison.distributed import shard_stream


class Items(IterableDataset):
    def __iter__(self):
        for i in range(12):
            yield torch.full((4,), float(i)), i % 2


def build(seed):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    return shard_stream(Items()), TensorDataset(x, (x[:, 0] > 0).long())
"""

BODY = """\
name: streamed
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject streamdata.build
training:
  max_epochs: 1
  batch_size: 4
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
"""


class Plain(IterableDataset):
    """A stream that says nothing of ranks or of its position."""

    def __iter__(self):  # noqa: ANN204
        yield from range(4)


def _plan(tmp_path: Path, extra: str = "") -> RunPlan:
    (tmp_path / "streamdata.py").write_text(DATA)
    path = tmp_path / "config.yaml"
    path.write_text(BODY + extra)
    return plan(load_config(path))


def _line(tmp_path: Path, text: str) -> int:
    lines = (tmp_path / "config.yaml").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_a_stream_trains_when_training_shuffle_is_not_written(tmp_path: Path) -> None:
    planned = _plan(tmp_path)
    datasets = planned.resolved.data_build(seed=0)
    assert planned.loaders.training.shuffle is True  # the schema's default, for map-style data
    assert train_shuffle(planned, datasets[0]) is None  # the source decides
    assert train_shuffle(planned, datasets[1]) is True
    train_loader, _ = build_loaders(planned, Datasets(*datasets))
    assert train_loader is not None
    assert [int(b[1].sum()) for b in train_loader] == [2, 2, 2]  # the source's order, 12 items


def test_training_shuffle_true_written_for_a_stream_is_refused_at_its_line(tmp_path: Path) -> None:
    planned = _plan_with_shuffle(tmp_path)
    with pytest.raises(ConfigError) as err:
        build_loaders(planned, Datasets(*planned.resolved.data_build(seed=0)))
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'config.yaml'}:{_line(tmp_path, 'shuffle: true')}: training.shuffle:")
    assert "a stream shuffles itself" in message and "Remove training.shuffle" in message


def _plan_with_shuffle(tmp_path: Path) -> RunPlan:
    (tmp_path / "streamdata.py").write_text(DATA)
    path = tmp_path / "config.yaml"
    path.write_text(BODY.replace("  batch_size: 4\n", "  batch_size: 4\n  shuffle: true\n"))
    return plan(load_config(path))


def test_a_stream_that_does_not_split_by_rank_is_refused_naming_data_build(tmp_path: Path) -> None:
    planned = _plan(tmp_path)
    check_stream_sharding(planned, Plain(), 1)  # one rank reads it whole: nothing to split
    check_stream_sharding(planned, planned.resolved.data_build(seed=0)[0], 2)
    with pytest.raises(ConfigError) as err:
        check_stream_sharding(planned, Plain(), 2)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'config.yaml'}:{_line(tmp_path, 'build:')}: data.build:")
    assert "Plain" in message and "2 ranks" in message and "shard_stream(dataset)" in message


def test_mid_epoch_saves_of_a_positionless_stream_are_refused_naming_the_keys(tmp_path: Path) -> None:
    planned = _plan(tmp_path, "checkpoint:\n  every_iters: 5\n")
    loader = DataLoader(Plain(), batch_size=2)  # a plain DataLoader: nothing keeps the stream's position
    with pytest.raises(ConfigError) as err:
        check_mid_epoch_saves(planned, loader)
    message = str(err.value)
    config = tmp_path / "config.yaml"
    every = _line(tmp_path, "every_iters")
    assert message.startswith(f"{config}:{every}: checkpoint.every_iters:")
    assert f"checkpoint.every_iters: 5 ({config}:{every})" in message
    assert "checkpoint.preemption: true (default)" in message
    assert "checkpoint.preemption: false" in message and "saves its position" in message
    assert "Plain" in message

    preempt_only = _plan(tmp_path, "checkpoint:\n  preemption: true\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.preemption: .*true \(.*config\.yaml:\d+\)"):
        check_mid_epoch_saves(preempt_only, loader)

    epoch_ends = _plan(tmp_path, "checkpoint:\n  preemption: false\n")
    check_mid_epoch_saves(epoch_ends, loader)  # saves at epoch ends only: allowed
    map_style, _ = prepare_loaders(list(range(4)), batch_size=2)
    check_mid_epoch_saves(_plan(tmp_path), map_style)  # a map-style loader's sampler tells
