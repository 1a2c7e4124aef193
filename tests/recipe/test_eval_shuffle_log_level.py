"""validation.shuffle and testing.shuffle (EvalSampler's shuffle), log_level, and every unknown key
of a config named in one error."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from unison.config import Config, ConfigError, load_config
from unison.distributed import EvalSampler
from unison.engine import create_evaluator
from unison.metrics import Accuracy, MeanAbsoluteError
from unison.recipe.build.eval_loaders import eval_loader
from unison.recipe.planning.loader_plan import loader_plans
from unison.utils.logging import console_level, setup_logging

MINIMAL = "model:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject torch.nn.Linear\n"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shuffled_eval_shards_deal_every_sample_once_in_a_new_order_each_pass(world: int) -> None:
    samplers = [EvalSampler(range(11), rank=r, world_size=world, shuffle=True, seed=5) for r in range(world)]
    first = [list(s) for s in samplers]
    second = [list(s) for s in samplers]
    for shards in (first, second):
        assert sorted(i for shard in shards for i in shard) == list(range(11))
        assert [len(s) for s in shards] == [len(s) for s in samplers]
    assert first != second  # a new order at each pass
    again = [
        list(EvalSampler(range(11), rank=r, world_size=world, shuffle=True, seed=5)) for r in range(world)
    ]
    assert again == first  # the same orders on any rank that makes the sampler with the seed


def _evaluate(shuffle: bool, section: str) -> list[dict[str, float]]:
    config = Config()
    config.validation.batch_size = 4
    getattr(config, section).shuffle = shuffle
    x = torch.arange(-9.0, 10.0).reshape(-1, 1)
    data = TensorDataset(x, x * 3 % 5 - 2)  # integer targets: sums exact in any order
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    classifier = nn.Linear(1, 3)
    loader = eval_loader(getattr(loader_plans(config), section), data)
    out = []
    for _ in range(2):
        mae = create_evaluator(model, {"mae": MeanAbsoluteError()}).run(loader).metrics
        labels = TensorDataset(x, (x.squeeze(1) % 3).long())
        acc = (
            create_evaluator(classifier, {"acc": Accuracy()})
            .run(eval_loader(getattr(loader_plans(config), section), labels))
            .metrics
        )
        out.append({"mae": mae["mae"], "acc": acc["acc"]})
    return out


@pytest.mark.parametrize("section", ["validation", "testing"])
def test_shuffled_evaluation_gives_exactly_the_unshuffled_metrics(section: str) -> None:
    torch.manual_seed(0)
    plain = _evaluate(False, section)
    torch.manual_seed(0)
    shuffled = _evaluate(True, section)
    assert shuffled == plain  # exactly, at each of two evaluations


def test_eval_loader_shuffles_as_its_section_says() -> None:
    config = Config()
    config.validation.shuffle = True
    data = list(range(10))
    val = eval_loader(loader_plans(config).validation, data)
    test = eval_loader(loader_plans(config).testing, data)
    assert val.sampler.shuffle and not test.sampler.shuffle
    assert val.sampler.seed == config.training.seed


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(MINIMAL + text)
    return path


def test_log_level_any_case_and_a_bad_one_names_the_key(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "log_level: debug\n")).log_level == "DEBUG"
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "log_level: loud\n"))
    assert info.value.key_path == "log_level" and info.value.line == 5


def test_console_level_below_the_logger_lets_the_records_through() -> None:
    logger = setup_logging(rank=1, world_size=2)  # a rank above 0: WARNING
    try:
        with console_level(logging.DEBUG):
            assert logger.isEnabledFor(logging.DEBUG)
        assert logger.level == logging.WARNING
    finally:
        setup_logging()


def test_every_unknown_key_is_named_at_once(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "training:\n  num_epoch: 3\n  batchsize: 4\nlog_levl: INFO\nvalidation:\n  shufle: true\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert info.value.key_path == "training.num_epoch" and info.value.line == 6
    assert "4 unknown keys" in message
    for line, key, near in [
        (6, "training.num_epoch", "num_epochs"),
        (7, "training.batchsize", "batch_size"),
        (8, "log_levl", "log_level"),
        (10, "validation.shufle", "shuffle"),
    ]:
        assert f"{path}:{line}: {key}: unknown key" in message and f"Did you mean {near!r}" in message
