"""unison/config/origin.py: one locator for every config error, carried by the config it describes."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest

from unison.config import Config, ConfigError, Origin, apply_overrides, dump_config, load_config, load_yaml
from unison.recipe.planning.references import _References

BASE = """\
name: base
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject torch.utils.data.random_split
training:
  lr: 0.1
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(BASE)
    return path


def test_a_loaded_config_carries_its_origin(base: Path) -> None:
    config = load_config(base, ["training.max_epochs=7"])
    origin = config.origin
    assert isinstance(origin, Origin)
    assert origin.file == str(base.resolve())
    assert origin.lines[("training", "lr")] == 8
    assert origin.overrides == {("training", "max_epochs"): "training.max_epochs=7"}
    assert origin.given("training", "lr") and origin.given("training", "max_epochs")
    assert not origin.given("training", "batch_size")  # a default
    for copied in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):  # as ranks receive it
        assert copied.origin == origin


def test_the_origin_is_not_a_key_of_the_config(base: Path, tmp_path: Path) -> None:
    config = load_config(base)
    assert "origin" not in {f.name for f in dataclasses.fields(Config)}
    assert "origin" not in dump_config(config)
    assert config == load_config(base)  # compared by its keys
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE + "origin: here\n")
    with pytest.raises(ConfigError, match="unknown key 'origin'"):
        load_config(bad)


def test_a_config_built_in_python_has_no_origin() -> None:
    err = Config().origin.error(("training", "lr"), "must be > 0")
    assert str(err) == "<config>: training.lr: must be > 0"


def test_the_locator_names_the_file_and_line_or_the_set(base: Path) -> None:
    origin = load_config(base, ["model.kwargs.out_features=3"]).origin
    file = str(base.resolve())
    assert str(origin.error(("training", "lr"), "bad")) == f"{file}:8: training.lr: bad"
    assert (
        str(origin.error(("training", "lr", "x"), "bad")) == f"{file}:8: training.lr.x: bad"
    )  # nearest line
    assert str(origin.error(("model", "kwargs", "out_features"), "bad")) == (
        "--set model.kwargs.out_features=3: model.kwargs.out_features: bad"
    )
    # a --set below the key gave it its shape: the --set is named, not the file
    assert (
        str(origin.error(("model", "kwargs"), "bad"))
        == "--set model.kwargs.out_features=3: model.kwargs: bad"
    )


def test_cli_errors_and_validation_errors_come_from_one_locator(base: Path) -> None:
    config = load_config(base, ["model.kwargs.out_features=3"])
    refs = _References.of(config)
    for key in ("training.lr", "model.kwargs", "model.kwargs.out_features", "data.build"):
        path = tuple(key.split("."))
        assert str(refs.error(key, "bad")) == str(config.origin.error(path, "bad"))


def test_given_counts_merged_keys_and_a_set_that_replaces_a_section(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text(BASE + "defaults: &d {patience: 3}\nearly_stopping:\n  <<: *d\n  metric: loss\n")
    origin = load_yaml(path).origin
    assert origin.given("early_stopping", "patience")  # written through the merge key
    assert origin.given("early_stopping", "metric") and not origin.given("early_stopping", "mode")
    raw = apply_overrides(load_yaml(path), ["early_stopping={mode: min}"])
    assert raw.origin.given("early_stopping", "mode")
    assert not raw.origin.given("early_stopping", "patience")  # the section was replaced
    assert raw.origin.from_command_line(("early_stopping", "mode"))
    assert not raw.origin.from_command_line(("training", "lr"))


def test_a_port_that_is_not_a_number_is_located(base: Path, tmp_path: Path) -> None:
    path = tmp_path / "port.yaml"
    path.write_text(BASE + "parallel:\n  master_port: 'http'\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:10: parallel.master_port: expected a port number, got 'http'"
