"""unison/config/overrides.py: ``--set KEY.PATH=VALUE``, and dump_config / to_plain round trips."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

from unison.config import (
    ConfigError,
    PyObjectRef,
    apply_overrides,
    dump_config,
    load_config,
    load_yaml,
    to_plain,
)

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "recipes" / "digits" / "config.yaml"

BASE = """\
name: base
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject torch.utils.data.random_split
training:
  lr: 0.1
  max_epochs: 3
"""


@pytest.fixture
def base(tmp_path) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(BASE)
    return path


def _set(path: Path, *items: str):
    return load_config(path, list(items))


# -- values are read as YAML ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("0.0003", 0.0003),
        ("1.5e-3", 1.5e-3),
        pytest.param(
            "3e-4",
            3e-4,
        ),
    ],
)
def test_a_float_override_gives_a_float(base, text, value):
    config = _set(base, f"training.lr={text}")
    assert config.training.lr == pytest.approx(value)
    assert isinstance(config.training.lr, float)


def test_exponent_floats_in_kwargs_are_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE.replace("training:\n", "training:\n  optimizer_kwargs: {lr: 1e-3, eps: 1e-8}\n"))
    kwargs = load_config(path).training.optimizer_kwargs
    assert kwargs == {"lr": 1e-3, "eps": 1e-8}, kwargs


def test_an_override_replaces_the_files_value_and_remembers_its_origin(base):
    raw = apply_overrides(load_yaml(base), ["training.max_epochs=7"])
    assert raw.data["training"]["max_epochs"] == 7
    assert raw.origin.file_of(("training", "max_epochs")) == "--set training.max_epochs=7"
    assert raw.origin.line_of(("training", "max_epochs")) is None
    assert raw.origin.file_of(("training", "lr")) == str(base)  # untouched keys keep the file
    assert base.read_text() == BASE


def test_lists_mappings_and_null(base):
    config = _set(
        base,
        "imports=[json, math]",
        "model.kwargs={in_features: 8, out_features: 1}",
        "training.lr=null",
        "training.epoch_length=~",
    )
    assert config.imports == ["json", "math"]
    assert config.model.kwargs == {"in_features": 8, "out_features": 1}
    assert config.training.lr is None and config.training.epoch_length is None


def test_strings_booleans_and_empty(base):
    config = _set(
        base, "name=my run", "logging.progress=false", "training.device=", "training.drop_last=true"
    )
    assert config.name == "my run"
    assert config.logging.progress is False and config.training.drop_last is True
    assert config.training.device == ""


def test_a_value_may_contain_equals_signs(base):
    config = _set(base, "name=a=b=c")
    assert config.name == "a=b=c"


def test_pyobject_via_set_names_the_override_as_its_origin(base):
    item = "training.scheduler_type=!pyobject torch.optim.lr_scheduler.StepLR"
    config = _set(base, item, "validation.metrics={acc: !pyobject unison.metrics.Accuracy}")
    ref = config.training.scheduler_type
    assert ref == PyObjectRef("torch.optim.lr_scheduler.StepLR", f"--set {item}", 0)
    assert (ref.file, ref.line) == (f"--set {item}", 0)
    assert config.validation.metrics["acc"].path == "unison.metrics.Accuracy"
    assert config.validation.metrics["acc"].file.startswith("--set validation.metrics=")


def test_a_refused_pyobject_via_set_names_the_override():
    """The error from resolving a --set reference names the --set, not the file."""
    import unison.recipe.planning.resolved

    path = Path(__file__).parent / "data" / "quantumgrav.yaml"
    item = "training.loss=!pyobject os.system"
    config = load_config(
        path, ["parallel.master_port=12355", "imports=[]", "data.build=!pyobject torch.randn", item]
    )
    with pytest.raises(ConfigError) as info:
        unison.recipe.planning.resolved.resolve(config)
    assert str(info.value).startswith(f"--set {item}: training.loss: ")


def test_later_overrides_win(base):
    config = _set(base, "training.lr=0.5", "training.max_epochs=2", "training.lr=0.25")
    assert (config.training.lr, config.training.max_epochs) == (0.25, 2)


def test_an_override_creates_a_missing_section(base):
    assert "early_stopping" not in BASE
    config = _set(base, "early_stopping.patience=3", "early_stopping.mode=min")
    assert config.early_stopping.patience == 3 and config.early_stopping.mode == "min"


def test_an_override_fills_a_null_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE + "checkpoint:\n")
    assert _set(path, "checkpoint.keep_last=5").checkpoint.keep_last == 5


def test_an_override_may_use_an_alias(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE.replace("  max_epochs: 3\n", ""))
    config = _set(path, "training.num_epochs=9", "parallel.world_size=2")
    assert config.training.max_epochs == 9 and config.parallel.nproc_per_node == 2


@pytest.mark.parametrize(
    "in_file, override",
    [
        pytest.param("num_epochs", "max_epochs", id="file-alias"),
        pytest.param("max_epochs", "num_epochs", id="file-key"),
    ],
)
def test_an_override_wins_over_the_files_alias(tmp_path, in_file, override):
    path = tmp_path / "c.yaml"
    path.write_text(BASE.replace("max_epochs: 3", f"{in_file}: 3"))
    assert _set(path, f"training.{override}=1").training.max_epochs == 1


# -- errors name the override ---------------------------------------------------------------


@pytest.mark.parametrize(
    "item, needle",
    [
        ("training.lr", "KEY.PATH=VALUE"),
        ("=3", "KEY.PATH=VALUE"),
        (".lr=3", "KEY.PATH=VALUE"),
        ("training.lr.x=1", "training.lr is a float, not a section"),
        ("name.first=1", "name is a str, not a section"),
        ("training.lr={a: [1, 2}", "not valid YAML"),
        ("training.lr=!!python/name:os.system", "not valid YAML"),
    ],
)
def test_a_malformed_override_names_itself(base, item, needle):
    with pytest.raises(ConfigError) as info:
        _set(base, "training.seed=1", item, "training.seed=2")
    assert str(info.value).startswith(f"--set {item}: "), str(info.value)
    assert needle in str(info.value)
    assert info.value.line is None


@pytest.mark.parametrize(
    "item, key, needle",
    [
        ("training.lr=fast", "training.lr", "expected float"),
        ("training.batch_size=-1", "training.batch_size", "must be > 0"),
        ("training.optimizer_type=torch.optim.SGD", "training.optimizer_type", "expected !pyobject"),
        ("logging=[1]", "logging", "expected a mapping"),
    ],
)
def test_a_bad_value_names_the_override_and_the_key(base, item, key, needle):
    with pytest.raises(ConfigError) as info:
        _set(base, item)
    assert str(info.value).startswith(f"--set {item}: {key}: "), str(info.value)
    assert needle in str(info.value)


def test_an_override_that_fixes_a_file_error_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE.replace("lr: 0.1", "lr: fast"))
    with pytest.raises(ConfigError):
        load_config(path)
    assert load_config(path, ["training.lr=0.2"]).training.lr == 0.2


# -- dump_config and to_plain ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["digits", "overridden"])
def test_dump_config_loads_back_to_the_same_config(source, base, tmp_path):
    if source == "digits":
        config = load_config(DIGITS)
    else:
        config = _set(
            base,
            "training.scheduler_type=!pyobject torch.optim.lr_scheduler.StepLR",
            "training.scheduler_kwargs={step_size: 2, gamma: 0.5}",
            "imports=[json]",
            "model.kwargs={in_features: 4, out_features: 2, bias: false}",
        )
    text = dump_config(config)
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    again = load_config(path)
    assert to_plain(again) == to_plain(config)
    assert dump_config(again) == text  # a fixed point
    # every default is written out
    assert "sync_every: 100" in text and "keep_best:" in text


def test_dump_config_round_trip_is_equal(tmp_path):
    config = load_config(DIGITS)
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_dump_config_is_safe_yaml_for_unison_only():
    text = dump_config(load_config(DIGITS))
    assert "!!python" not in text
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.safe_load(text)  # the !pyobject tag is unison's own


def _plain_only(value, where="config"):
    if isinstance(value, dict):
        for k, v in value.items():
            assert type(k) is str, f"{where}: key {k!r}"
            _plain_only(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain_only(v, f"{where}.{i}")
    else:
        assert value is None or type(value) in (str, int, float, bool), f"{where}: {type(value).__name__}"


def test_to_plain_gives_plain_data_that_weights_only_load_accepts(base):
    config = _set(
        base,
        "training.scheduler_type=!pyobject torch.optim.lr_scheduler.StepLR",
        "validation.metrics={acc: !pyobject unison.metrics.Accuracy}",
        "model.kwargs={in_features: 4, out_features: 2, sizes: [1, 2]}",
    )
    plain = to_plain(config)
    _plain_only(plain)
    assert plain["training"]["scheduler_type"] == "!pyobject torch.optim.lr_scheduler.StepLR"
    assert plain["validation"]["metrics"] == {"acc": "!pyobject unison.metrics.Accuracy"}
    assert plain["model"]["kwargs"]["sizes"] == [1, 2]
    buffer = io.BytesIO()
    torch.save({"config": plain}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == {"config": plain}


def test_to_plain_keeps_the_config_unchanged(base):
    config = _set(base)
    before = dump_config(config)
    to_plain(config)
    assert dump_config(config) == before
