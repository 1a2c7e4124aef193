"""unison/config/schema.py: typed sections, defaults, aliases, value checks; QuantumGrav's config."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch

import unison.recipe.planning.resolved
from unison.config import Config, ConfigError, PyObjectRef, load_config, load_yaml, schema_reference, validate
from unison.config.schema import REQUIRED, _hints, item_section, section_in
from unison.config.watched import watched_of

DATA = Path(__file__).parent / "data"
MINIMAL = (
    "model:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject torch.utils.data.random_split\n"
)


def _validate(text: str, name: str = "c.yaml") -> Config:
    return validate(load_yaml(name, text=text))


def test_a_minimal_config_takes_every_default():
    config = _validate(MINIMAL)
    default = Config()
    for f in dataclasses.fields(Config):
        if f.name not in ("model", "data", "checkpoint"):
            assert getattr(config, f.name) == getattr(default, f.name), f.name
    # the watched metric is the training loss (no validation.metrics): the plan derives min; the
    # config keeps the mode as written (left out)
    assert config.checkpoint.mode is None and watched_of(config).mode == "min"
    assert config.checkpoint == default.checkpoint
    assert config.model.type.path == "torch.nn.Linear"
    assert config.training.optimizer_type.path == "torch.optim.AdamW"
    assert config.training.loss.path == "torch.nn.functional.cross_entropy"


def test_required_keys_are_model_type_and_data_build():
    assert REQUIRED == (("model", "type"), ("data", "build"))
    for path in REQUIRED:
        text = MINIMAL.replace(f"{path[1]}: !pyobject", "# removed: !pyobject")
        with pytest.raises(ConfigError) as info:
            _validate(text)
        assert info.value.key_path == ".".join(path)
        assert "required" in str(info.value)


def test_an_empty_section_takes_its_defaults():
    config = _validate(MINIMAL + "training:\nvalidation: {}\n")
    assert config.training == Config().training
    assert config.validation == Config().validation


def test_sections_are_independent_between_configs():
    """Mutable defaults (dicts, lists) are not shared between two validated configs."""
    a, b = _validate(MINIMAL), _validate(MINIMAL)
    a.training.optimizer_kwargs["lr"] = 1.0
    a.imports.append("json")
    assert b.training.optimizer_kwargs == {} and b.imports == []
    assert Config().training.optimizer_kwargs == {}


@pytest.mark.parametrize(
    "section, key",
    [
        pytest.param("parallel", "timeout", id="float"),
        pytest.param("training", "lr", id="optional-float"),
        pytest.param("training", "clip_grad_norm", id="optional-float-2"),
    ],
)
def test_an_int_for_a_float_becomes_a_float(section, key):
    config = _validate(MINIMAL + f"{section}:\n  {key}: 2\n")
    value = getattr(getattr(config, section), key)
    assert value == 2 and type(value) is float, repr(value)


@pytest.mark.parametrize(
    "line, key",
    [
        ("  batch_size: true", "training.batch_size"),
        ("  lr: true", "training.lr"),
        ("  pin_memory: 1", "training.pin_memory"),
        ("  amp: 16", "training.amp"),
        ("  optimizer_type: torch.optim.SGD", "training.optimizer_type"),
        ("  optimizer_kwargs: [1, 2]", "training.optimizer_kwargs"),
    ],
)
def test_types_are_strict(line, key):
    """A bool is not an int, an int is not a bool, a string is not a !pyobject."""
    text = MINIMAL + "training:\n" + line + "\n"
    with pytest.raises(ConfigError) as info:
        _validate(text)
    assert str(info.value).startswith(f"c.yaml:{text.splitlines().index(line) + 1}: {key}: expected ")


def test_a_list_of_str_checks_its_items():
    text = MINIMAL + "imports: [json, 3]\n"
    with pytest.raises(ConfigError) as info:
        _validate(text)
    assert str(info.value).startswith(f"c.yaml:{len(text.splitlines())}: imports: expected a list of str")


def test_literals_accept_their_values_only():
    config = _validate(MINIMAL + "training:\n  amp: bf16\n  lr_scaling: sqrt\nparallel:\n  backend: gloo\n")
    assert (config.training.amp, config.training.lr_scaling, config.parallel.backend) == (
        "bf16",
        "sqrt",
        "gloo",
    )


@pytest.mark.parametrize(
    "section, alias, name, value",
    [("training", "num_epochs", "max_epochs", 7), ("parallel", "world_size", "nproc_per_node", 3)],
)
def test_aliases_map_to_their_key(section, alias, name, value):
    config = _validate(MINIMAL + f"{section}:\n  {alias}: {value}\n")
    assert getattr(getattr(config, section), name) == value


@pytest.mark.parametrize(
    "first, second",
    [
        pytest.param("max_epochs", "num_epochs", id="key-then-alias"),
        pytest.param(
            "num_epochs",
            "max_epochs",
            id="alias-then-key",
        ),
    ],
)
def test_an_alias_and_its_key_together_are_refused_naming_both(first, second):
    text = MINIMAL + f"training:\n  {first}: 3\n  {second}: 4\n"
    with pytest.raises(ConfigError) as info:
        _validate(text)
    message = str(info.value)
    assert message.startswith(f"c.yaml:{len(text.splitlines())}: training.{second}: ")
    assert "'num_epochs'" in message and "'max_epochs'" in message, message


def test_unknown_key_lists_valid_keys_and_the_nearest():
    with pytest.raises(ConfigError) as info:
        _validate(MINIMAL + "early_stopping:\n  patiense: 3\n")
    message = str(info.value)
    assert "Did you mean 'patience'?" in message
    for f in dataclasses.fields(type(Config().early_stopping)):
        assert f.name in message


def test_unknown_key_without_a_near_one_gives_no_guess():
    with pytest.raises(ConfigError) as info:
        _validate(MINIMAL + "training:\n  zzzzzz: 3\n")
    assert "Did you mean" not in str(info.value)
    assert info.value.key_path == "training.zzzzzz"


def test_unknown_key_suggests_an_alias_too():
    with pytest.raises(ConfigError) as info:
        _validate(MINIMAL + "training:\n  num_epoch: 3\n")
    assert "Did you mean 'num_epochs'?" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(ConfigError) as info:
        _validate(MINIMAL + "parallel:\n  backend: nccl\n")
    assert info.value.key_path == "parallel.backend" and "gloo" in str(info.value)


def test_load_config_records_the_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL)
    assert load_config(path).origin.file == str(path.resolve())


def test_schema_reference_documents_every_key():
    rows = schema_reference()
    keys = [row[0] for row in rows]
    assert len(keys) == len(set(keys))
    assert all(doc.strip() for _, _, _, doc in rows), [k for k, _, _, d in rows if not d.strip()]
    table = {key: (tp, default, doc) for key, tp, default, doc in rows}
    assert table["training.max_epochs"][0] == "int" and "num_epochs" in table["training.max_epochs"][2]
    assert table["parallel.nproc_per_node"][2].endswith("(also read as `world_size`)")
    assert table["training.optimizer_type"][1] == "!pyobject torch.optim.AdamW"

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            value = getattr(cls(), f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, PyObjectRef):
                yield from leaves(type(value), prefix + f.name + ".")
            else:
                yield prefix + f.name
                sub = section_in(_hints(cls)[f.name])
                if sub is not None:  # a key that also takes a mapping: training.ema, training.lr_scaling
                    yield from leaves(sub, prefix + f.name + ".")
                items = item_section(_hints(cls)[f.name])
                if items is not None:  # a list of sections: handlers.<i>.type
                    yield from leaves(items, prefix + f.name + ".<i>.")

    assert sorted(keys) == sorted(leaves(Config))


# -- QuantumGrav: its users' config, as they write it ---------------------------------------

QG_DATA = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset


class GNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x)


def build(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return ds, ds, ds
"""

USER_SCRIPT = """\
import torch


def compute_loss(y_pred, y):
    return torch.nn.functional.cross_entropy(y_pred, y)
"""

FILLED_IN = "imports: [qg_data]\ndata:\n  build: !pyobject qg_data.build\n  kwargs: {n: 16}\n"
"""What a QuantumGrav user adds to the guide's block: their own data, in a module of theirs."""


@pytest.fixture
def quantumgrav(tmp_path, monkeypatch):
    """tests/config/data/quantumgrav_ddp.yaml (QuantumGrav's DDP guide, verbatim) with the user's data
    section appended; their `qg_data` module on sys.path (not next to it), and `__main__` their script,
    defining `compute_loss`, as when they run the config through `unison.recipe.run`."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "qg_data.py").write_text(QG_DATA)
    monkeypatch.syspath_prepend(str(code))
    script = types.ModuleType("__main__")
    script.__file__ = str(code / "train_qg.py")
    exec(compile(USER_SCRIPT, script.__file__, "exec"), script.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", script)
    sys.modules.pop("qg_data", None)
    path = tmp_path / "config.yaml"
    path.write_text((DATA / "quantumgrav_ddp.yaml").read_text() + FILLED_IN)
    yield path
    sys.modules.pop("qg_data", None)


def _check_quantumgrav(config: Config) -> None:
    assert config.training.max_epochs == 50  # num_epochs
    assert config.parallel.nproc_per_node == 3  # world_size
    assert config.parallel.master_addr == "localhost"
    assert config.parallel.master_port == 12355
    assert (config.parallel.rank, config.parallel.output_device) == (None, None)
    assert config.training.path == "/path/to/output/directory"  # the root of the run folders
    assert (config.parallel.find_unused_parameters, config.training.seed, config.training.device) == (
        False,
        42,
        "cuda",
    )
    assert config.training.optimizer_kwargs == {"lr": 0.001, "weight_decay": 0.00005}
    assert config.training.optimizer_args == []
    assert (config.training.batch_size, config.training.num_workers, config.training.prefetch_factor) == (
        64,
        4,
        2,
    )
    training = config.training
    assert (training.pin_memory, training.drop_last, training.checkpoint_at) == (True, True, 10)
    v, t = config.validation, config.testing
    cuda = {"device": "cuda"}
    assert (v.batch_size, v.num_workers, v.pin_memory, v.drop_last, v.validator) == (64, 2, True, False, cuda)
    assert (t.batch_size, t.num_workers, t.pin_memory, t.drop_last, t.tester) == (64, 2, True, False, cuda)
    es = config.early_stopping
    assert (es.type, es.args, es.kwargs, es.patience) == ("DefaultEarlyStopping", [], {}, 5)  # kwargs -> keys
    assert config.criterion == config.training.loss == PyObjectRef("__main__.compute_loss")
    assert config.model.type == "GNNModel"
    resolved = unison.recipe.planning.resolved.resolve(config)
    assert resolved.optimizer_type is torch.optim.AdamW
    assert resolved.model_type is sys.modules["qg_data"].GNNModel  # the name, found under imports:
    assert (
        resolved.loss.loss_fn is sys.modules["__main__"].compute_loss
    )  # the user's script, given the whole batch
    train, val, test = resolved.data_build(seed=config.training.seed, **resolved.data_kwargs)
    assert len(train) == len(val) == len(test) == 16


def test_quantumgrav_config_loads_verbatim(quantumgrav):
    block = (DATA / "quantumgrav_ddp.yaml").read_text()
    assert quantumgrav.read_text().startswith(block)  # every line of the guide's block, unmodified
    _check_quantumgrav(load_config(quantumgrav))


def test_quantumgrav_config_loads_with_an_unquoted_port(quantumgrav, tmp_path):
    text = quantumgrav.read_text()
    assert 'master_port: "12355"' in text
    path = tmp_path / "quantumgrav.yaml"
    path.write_text(text.replace('master_port: "12355"', "master_port: 12355"))
    _check_quantumgrav(load_config(path))


def test_quantumgrav_config_needs_its_import(quantumgrav, tmp_path):
    """Without `imports: [qg_data]` the data module (on sys.path, not in the config's folder)
    is outside the allow-list."""
    text = quantumgrav.read_text().replace('type: "GNNModel"', "type: !pyobject torch.nn.Identity")
    path = tmp_path / "qg.yaml"
    path.write_text(text.replace("imports: [qg_data]\n", ""))
    config = load_config(path)
    with pytest.raises(ConfigError) as info:
        unison.recipe.planning.resolved.resolve(config)
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if "qg_data.build" in row)
    assert str(info.value).startswith(f"{path}:{line}: data.build: ")
    assert "imports: [qg_data]" in str(info.value)
