"""QuantumGrav's DDP config, key by key: unison/config/compat.py, names.py and `__main__` in resolve.py.

The guide's block is tests/config/data/quantumgrav_ddp.yaml, verbatim; these tests append
what a user fills in (their data, their module) and change one key at a time. What the keys
do in a run is in tests/cli/test_quantumgrav_run.py.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from unison.config import ConfigError, PyObjectRef, load_config
from unison.config.resolve import Scope
from unison.handlers import EarlyStopping
from unison.metrics import BatchLoss
from unison.recipe.planning.resolved import resolve
from unison.recipe.planning.run_plan import plan

BLOCK = (Path(__file__).parent / "data" / "quantumgrav_ddp.yaml").read_text()

QG_USER = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset

from unison.handlers import EarlyStopping


class GNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x)


class NotAModel:
    pass


class PatientStop(EarlyStopping):
    def __init__(self, trainer, metric, *, extra_patience=0, **kwargs):
        kwargs["patience"] += extra_patience
        super().__init__(trainer, metric, **kwargs)


def compute_loss(y_pred, y):
    return nn.functional.cross_entropy(y_pred, y)


def qg_loss(outputs, data, trainer):
    return outputs.sum()


def build(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return ds, ds, ds
"""

FILLED_IN = "imports: [qg_user]\ndata:\n  build: !pyobject qg_user.build\n"


@pytest.fixture
def qg(tmp_path, monkeypatch):
    """Writes the user's module `qg_user` (on sys.path); returns fn(text) -> the path of a config file."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "qg_user.py").write_text(QG_USER)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # not pytest's: no script
    sys.modules.pop("qg_user", None)

    def write(text: str, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    yield write
    sys.modules.pop("qg_user", None)


def _user_block(**replace: str) -> str:
    """The guide's block with the criterion in the user's module, the user's data appended, and
    ``replace``'s lines swapped in (old line text -> new)."""
    text = BLOCK.replace("!pyobject __main__.compute_loss", "!pyobject qg_user.compute_loss") + FILLED_IN
    for old, new in replace.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _line(path: Path, text: str) -> int:
    return next(i for i, row in enumerate(path.read_text().splitlines(), 1) if text in row)


# -- criterion --------------------------------------------------------------------------------


def test_criterion_is_the_training_loss(qg):
    config = load_config(qg(_user_block()))
    assert config.criterion == config.training.loss == PyObjectRef("qg_user.compute_loss")
    loss = resolve(config).loss  # a function of the user's: called with the whole batch
    assert isinstance(loss, BatchLoss) and loss.loss_fn is sys.modules["qg_user"].compute_loss


def test_criterion_and_a_different_training_loss_is_an_error_naming_both(qg):
    text = _user_block(**{"  seed: 42\n": "  seed: 42\n  loss: !pyobject torch.nn.functional.mse_loss\n"})
    path = qg(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:1: criterion: ")
    assert "qg_user.compute_loss" in str(info.value) and "mse_loss" in str(info.value)
    same = text.replace("torch.nn.functional.mse_loss", "qg_user.compute_loss")
    assert load_config(qg(same, "same.yaml")).training.loss == PyObjectRef("qg_user.compute_loss")


def test_a_training_loss_set_on_the_command_line_wins_over_the_files_criterion(qg):
    config = load_config(qg(_user_block()), ["training.loss=!pyobject torch.nn.functional.nll_loss"])
    assert config.criterion is None and config.training.loss == PyObjectRef("torch.nn.functional.nll_loss")


def test_quantumgravs_three_argument_criterion_gets_the_trainer_and_needs_an_evaluation_criterion(qg):
    path = qg(_user_block(**{"qg_user.compute_loss": "qg_user.qg_loss"}))
    with pytest.raises(ConfigError) as info:  # evaluation calls criterion(outputs, batch)
        resolve(load_config(path))
    assert str(info.value).startswith(f"{path}:1: criterion: function qg_user.qg_loss needs a third argument")
    assert "validation.validator.criterion" in str(info.value)
    spec = 'validator: {device: "cuda", criterion: !pyobject qg_user.compute_loss}'
    text = _user_block(**{"qg_user.compute_loss": "qg_user.qg_loss", 'validator: {device: "cuda"}': spec})
    loss = resolve(load_config(qg(text, "with_validator.yaml"))).loss
    assert isinstance(loss, BatchLoss) and loss.with_trainer


# -- parallel.rank, parallel.output_device ------------------------------------------------------


def test_rank_is_null_or_a_number_and_output_device_a_device(qg):
    config = load_config(
        qg(_user_block(**{"rank: null": "rank: 2", "output_device: null": "output_device: 1"}))
    )
    assert (config.parallel.rank, config.parallel.output_device) == (2, 1)
    assert (
        load_config(
            qg(_user_block(**{"output_device: null": 'output_device: "cuda:1"'}))
        ).parallel.output_device
        == "cuda:1"
    )
    for line, key in (("rank: -1", "parallel.rank"), ('output_device: "gpu0"', "parallel.output_device")):
        old = "rank: null" if key == "parallel.rank" else "output_device: null"
        path = qg(_user_block(**{old: line}), "bad.yaml")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert str(info.value).startswith(f"{path}:{_line(path, line)}: {key}: ")


# -- training.optimizer_args --------------------------------------------------------------------


def test_optimizer_args_are_bound_after_the_parameters_before_spawn(qg):
    ok = _user_block(
        **{"optimizer_args: []": "optimizer_args: [0.01]", "{lr: 0.001, weight_decay": "{weight_decay"}
    )
    resolved = resolve(load_config(qg(ok)))
    assert resolved.optimizer_args == [0.01]
    path = qg(_user_block(**{"optimizer_args: []": "optimizer_args: [0.01]"}), "twice.yaml")
    with pytest.raises(ConfigError) as info:  # lr given positionally and in optimizer_kwargs
        resolve(load_config(path))
    assert "training.optimizer_kwargs" in str(info.value) and "multiple values for argument 'lr'" in str(
        info.value
    )


# -- validation / testing: loader keys and evaluator specs ---------------------------------------


def test_evaluator_specs_take_any_keys_but_a_device_must_be_one(qg):
    spec = 'validator: {device: "cuda", type: Validator, criterion: !pyobject os.system}'
    config = load_config(qg(_user_block(**{'validator: {device: "cuda"}': spec})))
    assert config.validation.validator["type"] == "Validator"  # accepted, never resolved nor called
    path = qg(_user_block(**{'tester: {device: "cuda"}': 'tester: {device: "gpu"}'}), "bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(
        f"{path}:{_line(path, 'tester:')}: testing.tester.device: 'gpu' is not a device"
    )


def test_evaluation_prefetch_needs_workers(qg):
    path = qg(
        _user_block(
            **{
                "  num_workers: 2\n  pin_memory: true\n  drop_last: false\n  validator": (
                    "  num_workers: 0\n  prefetch_factor: 2\n  pin_memory: true\n  drop_last: false\n  validator"
                )
            }
        )
    )
    with pytest.raises(ConfigError, match=r"validation.prefetch_factor: needs validation.num_workers > 0"):
        load_config(path)


# -- early_stopping: type, args, kwargs ---------------------------------------------------------


def test_early_stopping_kwargs_set_the_sections_keys(qg):
    kwargs = "kwargs: {patience: 3, delta: 0.01, mode: min, metric: loss}"
    es = load_config(qg(_user_block(**{"kwargs: {patience: 5}": kwargs}))).early_stopping
    assert (es.patience, es.min_delta, es.mode, es.metric, es.kwargs) == (3, 0.01, "min", "loss", {})
    es = load_config(qg(_user_block(**{"\n  args: []": "\n  args: [loss]"}), "args.yaml")).early_stopping
    assert (es.metric, es.args) == ("loss", [])


@pytest.mark.parametrize(
    ("old", "new", "key", "words"),
    [
        (
            "kwargs: {patience: 5}",
            "kwargs: {patience: 5}\n  patience: 4",
            "early_stopping.kwargs.patience",
            "keep one",
        ),
        (
            "kwargs: {patience: 5}",
            "kwargs: {patience: 5, mode: any}",
            "early_stopping.kwargs.mode",
            "one metric",
        ),
        ("kwargs: {patience: 5}", "kwargs: {patience: 5, tasks: {}}", "early_stopping.kwargs.tasks", "one"),
        ("\n  args: []", "\n  args: [loss, 5]", "early_stopping.args", "one positional argument"),
        ("kwargs: {patience: 5}", "kwargs: {}", "early_stopping.type", "no patience"),
    ],
)
def test_early_stopping_errors_name_the_key_and_the_fix(qg, old, new, key, words):
    path = qg(_user_block(**{old: new}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key_path == key and info.value.file == str(path) and info.value.line is not None
    assert words in str(info.value)


def test_early_stopping_type_names_unisons_handler_or_a_subclass_in_the_imports(qg):
    config = load_config(qg(_user_block()))
    from unison.recipe.planning.early_stop import early_stopping_slot
    from unison.recipe.planning.references import _References

    cls, args, extra = early_stopping_slot(config, _References.of(config))
    assert (cls, args, extra) == (EarlyStopping, [], {})  # DefaultEarlyStopping
    mine = _user_block(
        **{'"DefaultEarlyStopping"': "PatientStop", "{patience: 5}": "{patience: 5, extra_patience: 2}"}
    )
    config = load_config(qg(mine, "mine.yaml"))
    cls, _, extra = early_stopping_slot(config, _References.of(config))
    assert cls is sys.modules["qg_user"].PatientStop and extra == {"extra_patience": 2}


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("MyStopping", "It could name: DefaultEarlyStopping, EarlyStopping, qg_user.PatientStop."),
        ("GNNModel", "qg_user.GNNModel, which does not fit"),
        ("os.system", "refused"),
    ],
)
def test_an_early_stopping_type_that_is_no_handler_is_refused_with_candidates(qg, name, words):
    path = qg(_user_block(**{'"DefaultEarlyStopping"': name}))
    with pytest.raises(ConfigError) as info:
        plan(load_config(path))
    assert str(info.value).startswith(f"{path}:{_line(path, 'type: ' + name)}: early_stopping.type: ")
    assert words in str(info.value)


# -- model.type as a name -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ('"GraphModel"', "'GraphModel' is not found in qg_user. It could name: qg_user.GNNModel."),
        (
            '"NotAModel"',
            "qg_user.NotAModel, which does not fit: model.type accepts a torch.nn.Module subclass",
        ),
        ('"subprocess.run"', "refused"),
        ('"torch.load"', "refused"),
    ],
)
def test_a_model_name_found_nowhere_or_of_another_kind_is_refused(qg, name, words):
    path = qg(_user_block(**{'"GNNModel"': name}))
    with pytest.raises(ConfigError) as info:
        resolve(load_config(path))
    assert str(info.value).startswith(f"{path}:{_line(path, 'type: ' + name)}: model.type: ")
    assert words in str(info.value)


def test_a_dotted_model_name_reads_as_a_pyobject(qg):
    resolved = resolve(load_config(qg(_user_block(**{'"GNNModel"': '"qg_user.GNNModel"'}))))
    assert resolved.model_type is sys.modules["qg_user"].GNNModel


# -- __main__.compute_loss ------------------------------------------------------------------------


def _main_module(monkeypatch, *, file: str | None, cli: bool = False) -> types.ModuleType:
    script = types.ModuleType("__main__")
    if file is not None:
        script.__file__ = file
    exec(
        "import torch\ndef compute_loss(y_pred, y):\n    return torch.nn.functional.cross_entropy(y_pred, y)\n",
        script.__dict__,
    )
    if cli:  # the `unison` console script: `from unison.cli import main`
        from unison.cli import main

        script.main = main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", script)
    return script


def test_main_names_the_users_script_run_through_the_python_api(qg, monkeypatch, tmp_path):
    script = _main_module(monkeypatch, file=str(tmp_path / "train_qg.py"))
    config = load_config(qg(BLOCK + FILLED_IN))
    assert resolve(config).loss.loss_fn is script.compute_loss  # the criterion, called with the whole batch
    spawned = types.FunctionType(script.compute_loss.__code__, {}, "compute_loss")
    spawned.__module__ = "__mp_main__"  # how a spawned rank sees the script's functions
    assert Scope().is_users(spawned)


@pytest.mark.parametrize("shape", ["console script", "python -m unison", "no file"])
def test_main_under_unison_run_says_what_to_write_instead(qg, monkeypatch, tmp_path, shape):
    script = _main_module(
        monkeypatch,
        file=None if shape == "no file" else str(tmp_path / "unison"),
        cli=shape == "console script",
    )
    if shape == "python -m unison":
        script.__spec__ = types.SimpleNamespace(name="unison.__main__")  # type: ignore[assignment]
    path = qg(BLOCK + FILLED_IN)
    with pytest.raises(ConfigError) as info:
        resolve(load_config(path))
    message = str(info.value)
    assert message.startswith(f"{path}:1: criterion: !pyobject __main__.compute_loss: ")
    assert "`!pyobject mymodule.compute_loss` with `imports: [mymodule]`" in message
    assert "unison.recipe.run(path" in message
    if shape != "no file":
        assert "under `unison run`, `__main__` is the unison command itself" in message


def test_main_reaches_no_further_than_a_module_would(qg, monkeypatch, tmp_path):
    script = _main_module(monkeypatch, file=str(tmp_path / "train_qg.py"))
    exec("import os\nfrom os import system\nfrom torch import load\n", script.__dict__)
    for name, words in (("os.system", "through another module"), ("system", "refused"), ("load", "refused")):
        path = qg(BLOCK.replace("__main__.compute_loss", f"__main__.{name}") + FILLED_IN, f"{name}.yaml")
        with pytest.raises(ConfigError, match=words):
            resolve(load_config(path))
    assert torch.nn.functional.cross_entropy  # the torch of the script is the installed one
