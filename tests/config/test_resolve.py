"""unison/config/resolve.py and unison.cli.resolve.resolve: allow-list, denied prefixes, slots."""

from __future__ import annotations

import json
import sys
import uuid

import pytest
import torch

import unison.cli.resolve
from unison.config import (
    ALLOWED_PREFIXES,
    DENIED_PREFIXES,
    ConfigError,
    PyObjectRef,
    load_config,
    resolve_ref,
    resolve_tree,
)
from unison.metrics import Accuracy


def ref(path: str, line: int = 7) -> PyObjectRef:
    return PyObjectRef(path, "cfg.yaml", line)


def refused(path: str, *, slot=None, imports=(), config_dir=None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_ref(ref(path), slot=slot, key="training.loss", imports=imports, config_dir=config_dir)
    message = str(info.value)
    assert message.startswith("cfg.yaml:7: training.loss: "), message
    return message


@pytest.fixture
def local(tmp_path, monkeypatch):
    """Writes modules with unique names into tmp_path (on sys.path); forgets them afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(code: str, prefix: str = "unison_local") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(code)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


# -- the allow-list -------------------------------------------------------------------------


@pytest.mark.parametrize("slot", [None, "callable"])
def test_imports_allows_a_module(slot):
    assert resolve_ref(ref("json.dumps"), slot=slot, key="k", imports=["json"]) is json.dumps


def test_outside_the_allow_list_is_refused_with_the_fix():
    message = refused("json.dumps")
    assert "imports: [json]" in message
    for prefix in ALLOWED_PREFIXES:
        assert prefix.rstrip(".") in message


def test_an_import_prefix_matches_whole_module_names_only():
    """`imports: [js]` does not allow `json`."""
    assert "allow-list" in refused("json.dumps", imports=["js"])


def test_allowed_prefixes_resolve():
    assert resolve_ref(ref("torch.optim.SGD"), slot="torch.optim.Optimizer", key="k") is torch.optim.SGD
    assert resolve_ref(ref("unison.metrics.Accuracy"), slot="metric", key="k") is Accuracy
    import ignite.metrics

    assert resolve_ref(ref("ignite.metrics.Precision"), slot="metric", key="k") is ignite.metrics.Precision


def test_a_module_in_the_configs_folder_is_allowed(tmp_path, local):
    name = local("def build(seed):\n    return seed\n")
    obj = resolve_ref(ref(f"{name}.build"), slot="callable", key="data.build", config_dir=tmp_path)
    assert obj(5) == 5
    # The same module is refused for a config that lives elsewhere.
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert "allow-list" in refused(f"{name}.build", config_dir=other)


def test_a_package_in_the_configs_folder_is_allowed(tmp_path, local):
    name = f"unison_pkg_{uuid.uuid4().hex[:10]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("def build(seed):\n    return -seed\n")
    try:
        obj = resolve_ref(ref(f"{name}.build"), slot="callable", key="data.build", config_dir=tmp_path)
        assert obj(2) == -2
    finally:
        sys.modules.pop(name, None)


def test_recipe_resolve_finds_modules_next_to_the_config(tmp_path, monkeypatch):
    """A config and its recipe module in one folder, that folder not on sys.path."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"unison_recipe_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n\n"
        "class Net(torch.nn.Module):\n    def __init__(self, width=2):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(width, 1)\n\n"
        "def build(seed):\n    return [1], [2]\n"
    )
    path = tmp_path / "config.yaml"
    path.write_text(f"model:\n  type: !pyobject {name}.Net\ndata:\n  build: !pyobject {name}.build\n")
    try:
        resolved = unison.cli.resolve.resolve(load_config(path))
        module = sys.modules[name]
        assert resolved.model_type is module.Net and resolved.data_build is module.build
    finally:
        sys.modules.pop(name, None)


# -- denied prefixes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, imports",
    [
        ("os.system", ["os"]),
        ("os.path.join", ["os"]),
        ("subprocess.run", ["subprocess"]),
        ("builtins.eval", ["builtins"]),
        ("builtins.open", ["builtins"]),
        ("shutil.rmtree", ["shutil"]),
        ("pickle.loads", ["pickle"]),
        ("importlib.import_module", ["importlib"]),
        ("torch.load", []),
        ("torch.hub.load", []),
        ("torch.distributed.destroy_process_group", []),
        ("torch.multiprocessing.spawn", ["torch.multiprocessing"]),
    ],
)
def test_denied_prefixes_win_over_imports(path, imports):
    assert "refused" in refused(path, imports=imports)


def test_denied_prefixes_cover_what_runs_programs():
    for module in ("os", "subprocess", "builtins", "pickle", "shutil", "importlib", "ctypes"):
        assert module in DENIED_PREFIXES


def test_a_denied_prefix_does_not_catch_a_longer_module_name(local):
    """`io` is denied, `iox_...` is not: prefixes match whole module names."""
    name = local("def f():\n    return 1\n", prefix="iox")
    assert name.startswith("io") and any(p == "io" for p in DENIED_PREFIXES)
    assert resolve_ref(ref(f"{name}.f"), slot="callable", key="k", imports=[name])() == 1


@pytest.mark.parametrize("path", ["torch._C", "torch.nn.Module.__init__", "torch.nn._reduction.get_enum"])
def test_private_names_are_refused(path):
    assert "private" in refused(path)


@pytest.mark.parametrize("path", ["torch optim", "torch..optim", "torch.optim.", "1torch.x", ""])
def test_a_path_that_is_not_dotted_is_refused(path):
    assert "dotted path" in refused(path)


@pytest.mark.parametrize(
    "path",
    [
        "torch.os.system",  # torch/__init__.py does `import os`
        "unison.config.resolve.importlib.import_module",
        "torch.serialization.pickle.loads",
    ],
)
def test_a_denied_module_cannot_be_reached_through_an_allowed_one(path):
    refused(path)


# -- import failures ------------------------------------------------------------------------


def test_a_missing_module_is_named():
    assert "no module 'unison_no_such_mod'" in refused("unison_no_such_mod.f", imports=["unison_no_such_mod"])


def test_a_missing_attribute_is_named_with_a_near_name():
    message = refused("torch.optim.adamW")
    assert "has no 'adamW'" in message and "Did you mean torch.optim.AdamW?" in message


def test_a_module_that_raises_on_import_is_named(local):
    name = local("raise RuntimeError('boom at import')\n")
    message = refused(f"{name}.f", imports=[name])
    assert "RuntimeError: boom at import" in message


def test_a_module_whose_own_import_fails_is_named(local):
    """A module that exists but imports a missing one: the message says which, not 'no module'."""
    name = local("import unison_really_missing_dependency\n")
    message = refused(f"{name}.f", imports=[name])
    assert "unison_really_missing_dependency" in message


# -- slots ----------------------------------------------------------------------------------


def test_optimizer_slot_checks_the_class(local):
    name = local("class NotAnOptimizer:\n    def __init__(self, params, lr=0.1):\n        pass\n")
    message = refused(f"{name}.NotAnOptimizer", slot="torch.optim.Optimizer", imports=[name])
    assert "class NotAnOptimizer" in message and "torch.optim.Optimizer subclass" in message
    # a subclass of torch.optim.Optimizer fits
    assert resolve_ref(ref("torch.optim.AdamW"), slot="torch.optim.Optimizer", key="k") is torch.optim.AdamW


def test_optimizer_slot_refuses_an_instance_or_function():
    message = refused("torch.optim.lr_scheduler.LambdaLR.step", slot="torch.optim.Optimizer")
    assert "torch.optim.Optimizer subclass" in message


def test_scheduler_slot():
    cls = torch.optim.lr_scheduler.StepLR
    slot = "torch.optim.lr_scheduler.LRScheduler"
    assert resolve_ref(ref("torch.optim.lr_scheduler.StepLR"), slot=slot, key="k") is cls
    assert "LRScheduler subclass" in refused("torch.optim.Adam", slot=slot)


def test_model_slot_takes_a_module_class_or_a_function(local):
    name = local(
        "import torch\n\ndef make(width=3):\n    return torch.nn.Linear(width, 1)\n\nclass Plain:\n    pass\n"
    )
    assert resolve_ref(ref("torch.nn.Linear"), slot="model", key="model.type") is torch.nn.Linear
    assert resolve_ref(ref(f"{name}.make"), slot="model", key="model.type", imports=[name])().in_features == 3
    assert "torch.nn.Module subclass" in refused(f"{name}.Plain", slot="model", imports=[name])
    assert "not a model class" in refused("torch.float32", slot="model")


def test_metric_slot():
    assert "not a metric class" in refused("torch.nn.functional.cross_entropy", slot="metric")


def test_callable_slot():
    assert (
        resolve_ref(ref("torch.nn.functional.mse_loss"), slot="callable", key="k")
        is torch.nn.functional.mse_loss
    )
    assert "function or class" in refused("torch.float32", slot="callable")
    assert "function or class" in refused("torch.pi", slot="callable")


# -- nested kwargs and unison.cli.resolve.resolve ----------------------------------------------


def test_resolve_tree_resolves_nested_references_and_names_their_key():
    tree = {"act": ref("torch.nn.ReLU"), "layers": [1, {"norm": ref("torch.nn.LayerNorm")}], "n": 3}
    out = resolve_tree(tree, key="model.kwargs", imports=(), config_dir=None)
    assert out == {"act": torch.nn.ReLU, "layers": [1, {"norm": torch.nn.LayerNorm}], "n": 3}
    with pytest.raises(ConfigError) as info:
        resolve_tree({"layers": [0, ref("os.system")]}, key="model.kwargs", imports=(), config_dir=None)
    assert info.value.key_path == "model.kwargs.layers.1"


def _config(tmp_path, body: str):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject torch.utils.data.random_split\n"
        + body
    )
    return path, load_config(path)


def test_recipe_resolve_returns_every_object(tmp_path):
    _, config = _config(
        tmp_path,
        "training:\n  scheduler_type: !pyobject torch.optim.lr_scheduler.StepLR\n"
        "  scheduler_kwargs: {step_size: 2}\n"
        "validation:\n  metrics:\n    acc: !pyobject unison.metrics.Accuracy\n"
        "    loss:\n      type: !pyobject unison.metrics.Loss\n"
        "      kwargs: {loss_fn: !pyobject torch.nn.functional.nll_loss}\n",
    )
    r = unison.cli.resolve.resolve(config)
    assert r.optimizer_type is torch.optim.AdamW  # the default
    assert r.scheduler_type is torch.optim.lr_scheduler.StepLR and r.scheduler_kwargs == {"step_size": 2}
    assert r.loss is torch.nn.functional.cross_entropy
    assert r.model_type is torch.nn.Linear and r.data_build is torch.utils.data.random_split
    from unison.metrics import Loss

    assert r.metrics == {"acc": (Accuracy, {}), "loss": (Loss, {"loss_fn": torch.nn.functional.nll_loss})}
    assert r.after_training is None


def test_recipe_resolve_checks_the_metric_mapping_form(tmp_path):
    path, config = _config(
        tmp_path, "validation:\n  metrics:\n    acc: {typ: !pyobject unison.metrics.Accuracy}\n"
    )
    with pytest.raises(ConfigError) as info:
        unison.cli.resolve.resolve(config)
    assert info.value.key_path == "validation.metrics.acc"
    assert "'typ'" in str(info.value)


def test_recipe_resolve_names_the_key_and_slot_of_a_wrong_optimizer(tmp_path):
    path, config = _config(
        tmp_path, "training:\n  optimizer_type: !pyobject torch.optim.lr_scheduler.StepLR\n"
    )
    with pytest.raises(ConfigError) as info:
        unison.cli.resolve.resolve(config)
    line = len(path.read_text().splitlines())
    assert str(info.value).startswith(f"{path}:{line}: training.optimizer_type: ")
    assert "torch.optim.Optimizer" in str(info.value)


def test_recipe_resolve_uses_the_configs_imports(tmp_path):
    _, config = _config(tmp_path, "imports: [json]\nhooks:\n  after_training: !pyobject json.dumps\n")
    assert unison.cli.resolve.resolve(config).after_training is json.dumps
    _, config = _config(tmp_path, "imports: [os]\nhooks:\n  after_training: !pyobject os.system\n")
    with pytest.raises(ConfigError) as info:
        unison.cli.resolve.resolve(config)
    assert info.value.key_path == "hooks.after_training" and "refused" in str(info.value)
