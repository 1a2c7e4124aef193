"""unison/config/resolve.py and unison.recipe.planning.resolved.resolve: allow-list, denied prefixes, slots."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch

import unison.recipe.planning.resolved
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


@pytest.mark.parametrize("slot", [None, "hook"])
def test_imports_allows_a_users_module(slot, local):
    name = local("def f(context):\n    return 1\n")
    assert resolve_ref(ref(f"{name}.f"), slot=slot, key="k", imports=[name])(None) == 1


def test_imports_refuses_the_standard_library():
    assert "standard library" in refused("json.dumps", imports=["json"])


def test_outside_the_allow_list_is_refused_with_the_fix(local):
    name = local("def f(context):\n    return 1\n")
    message = refused(f"{name}.f")
    assert f"imports: [{name}]" in message
    for prefix in ALLOWED_PREFIXES:
        assert prefix.rstrip(".") in message


def test_an_import_prefix_matches_whole_module_names_only(local):
    """`imports: [unison_lo]` does not allow `unison_local_...`."""
    name = local("def f(context):\n    return 1\n")
    assert "allow-list" in refused(f"{name}.f", imports=["unison_lo"])


def test_allowed_prefixes_resolve():
    assert resolve_ref(ref("torch.optim.SGD"), slot="torch.optim.Optimizer", key="k") is torch.optim.SGD
    assert resolve_ref(ref("unison.metrics.Accuracy"), slot="metric", key="k") is Accuracy
    import ignite.metrics

    assert resolve_ref(ref("ignite.metrics.Precision"), slot="metric", key="k") is ignite.metrics.Precision


def test_a_module_in_the_configs_folder_is_allowed(tmp_path, local):
    name = local("def build(seed):\n    return seed\n")
    obj = resolve_ref(ref(f"{name}.build"), slot="data", key="data.build", config_dir=tmp_path)
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
        obj = resolve_ref(ref(f"{name}.build"), slot="data", key="data.build", config_dir=tmp_path)
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
    before = list(sys.path)
    resolved = unison.recipe.planning.resolved.resolve(load_config(path))
    assert sys.path == before, "the config's folder is never put on sys.path"
    assert name not in sys.modules, "imported by file path, under a private name"
    module = sys.modules[resolved.model_type.__module__]
    assert module.__file__ == str(tmp_path / f"{name}.py")
    assert resolved.model_type is module.Net and resolved.data_build is module.build


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
    assert resolve_ref(ref(f"{name}.f"), slot="hook", key="k", imports=[name])() == 1


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
    message = refused(f"{name}.NotAnOptimizer", slot="optimizer", imports=[name])
    assert f"class {name}.NotAnOptimizer" in message and "torch.optim.Optimizer subclass" in message
    # a subclass of torch.optim.Optimizer fits
    assert resolve_ref(ref("torch.optim.AdamW"), slot="torch.optim.Optimizer", key="k") is torch.optim.AdamW


def test_optimizer_slot_refuses_an_instance_or_function():
    message = refused("torch.optim.lr_scheduler.LambdaLR.step", slot="torch.optim.Optimizer")
    assert "torch.optim.Optimizer subclass" in message


def test_scheduler_slot():
    cls = torch.optim.lr_scheduler.StepLR
    slot = "torch.optim.lr_scheduler.LRScheduler"
    assert resolve_ref(ref("torch.optim.lr_scheduler.StepLR"), slot=slot, key="k") is cls
    assert "LRScheduler or ReduceLROnPlateau subclass" in refused("torch.optim.Adam", slot=slot)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    assert (
        resolve_ref(ref("torch.optim.lr_scheduler.ReduceLROnPlateau"), slot="scheduler", key="k") is plateau
    )


def test_model_slot_takes_a_module_class_or_a_function(local):
    name = local(
        "import torch\n\ndef make(width=3):\n    return torch.nn.Linear(width, 1)\n\nclass Plain:\n    pass\n"
    )
    assert resolve_ref(ref("torch.nn.Linear"), slot="model", key="model.type") is torch.nn.Linear
    assert resolve_ref(ref(f"{name}.make"), slot="model", key="model.type", imports=[name])().in_features == 3
    assert "torch.nn.Module subclass" in refused(f"{name}.Plain", slot="model", imports=[name])
    assert "found a dtype" in refused("torch.float32", slot="model")
    assert "found function torch.nn.functional.relu" in refused("torch.nn.functional.relu", slot="model")


def test_metric_slot():
    assert "found function torch.nn.functional" in refused("torch.nn.functional.cross_entropy", slot="metric")


def test_loss_slot():
    f = torch.nn.functional
    assert resolve_ref(ref("torch.nn.functional.mse_loss"), slot="loss", key="k") is f.mse_loss
    assert resolve_ref(ref("torch.nn.functional.gelu"), slot="loss", key="k") is f.gelu  # a builtin of F
    assert resolve_ref(ref("torch.nn.CrossEntropyLoss"), slot="loss", key="k") is torch.nn.CrossEntropyLoss
    assert "found a dtype" in refused("torch.float32", slot="loss")
    assert "found a float" in refused("torch.pi", slot="loss")
    assert "found built-in function" in refused("torch.from_file", slot="loss")


def test_hook_and_data_slots_take_the_users_functions_only(local):
    name = local(
        "import torch\nfrom torch.utils.data import random_split\n\ndef build(seed):\n    return 1, 2\n"
    )
    assert resolve_ref(ref(f"{name}.build"), slot="data", key="k", imports=[name])(0) == (1, 2)
    # a library function imported into the user's module is not the user's
    assert "function torch.utils.data" in refused(f"{name}.random_split", slot="data", imports=[name])
    assert "a function of your own modules" in refused("torch.utils.collect_env.run", slot="hook")


# -- nested kwargs and unison.recipe.planning.resolved.resolve ----------------------------------------------


def test_resolve_tree_resolves_nested_references_and_names_their_key():
    tree = {
        "act": ref("torch.nn.ReLU"),
        "layers": [1, {"norm": ref("torch.nn.LayerNorm")}],
        "n": 3,
        "dtype": ref("torch.float32"),
        "fn": ref("torch.nn.functional.gelu"),
    }
    out = resolve_tree(tree, key="model.kwargs", imports=(), config_dir=None)
    assert out == {
        "act": torch.nn.ReLU,
        "layers": [1, {"norm": torch.nn.LayerNorm}],
        "n": 3,
        "dtype": torch.float32,
        "fn": torch.nn.functional.gelu,
    }
    for path in ("torch.utils.collect_env.run", "torch.optim.SGD", "torch.nn", "ignite.utils.setup_logger"):
        with pytest.raises(ConfigError, match="inside kwargs"):
            resolve_tree({"x": ref(path)}, key="model.kwargs", imports=(), config_dir=None)
    with pytest.raises(ConfigError) as info:
        resolve_tree({"layers": [0, ref("os.system")]}, key="model.kwargs", imports=(), config_dir=None)
    assert info.value.key_path == "model.kwargs.layers.1"


DATA_NAME = "unison_resolve_data"


def _config(tmp_path, body: str):
    path = tmp_path / "c.yaml"
    path.write_text(
        f"model:\n  type: !pyobject torch.nn.Linear\n  kwargs: {{in_features: 2, out_features: 1}}\n"
        f"data:\n  build: !pyobject {DATA_NAME}.build\n" + body
    )
    (tmp_path / f"{DATA_NAME}.py").write_text("def build(seed):\n    return [1], [2]\n")
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
    r = unison.recipe.planning.resolved.resolve(config)
    assert r.optimizer_type is torch.optim.AdamW  # the default
    assert r.scheduler_type is torch.optim.lr_scheduler.StepLR and r.scheduler_kwargs == {"step_size": 2}
    assert r.loss is torch.nn.functional.cross_entropy
    assert r.model_type is torch.nn.Linear and r.data_build(seed=0) == ([1], [2])
    from unison.metrics import Loss

    assert r.metrics == {"acc": (Accuracy, {}), "loss": (Loss, {"loss_fn": torch.nn.functional.nll_loss})}
    assert r.after_training is None


def test_recipe_resolve_checks_the_metric_mapping_form(tmp_path):
    path, config = _config(
        tmp_path, "validation:\n  metrics:\n    acc: {typ: !pyobject unison.metrics.Accuracy}\n"
    )
    with pytest.raises(ConfigError) as info:
        unison.recipe.planning.resolved.resolve(config)
    assert info.value.key_path == "validation.metrics.acc"
    assert "'typ'" in str(info.value)


def test_recipe_resolve_names_the_key_and_slot_of_a_wrong_optimizer(tmp_path):
    path, config = _config(
        tmp_path, "training:\n  optimizer_type: !pyobject torch.optim.lr_scheduler.StepLR\n"
    )
    with pytest.raises(ConfigError) as info:
        unison.recipe.planning.resolved.resolve(config)
    line = len(path.read_text().splitlines())
    assert str(info.value).startswith(f"{path}:{line}: training.optimizer_type: ")
    assert "torch.optim.Optimizer" in str(info.value)


def test_recipe_resolve_uses_the_configs_imports(tmp_path, local):
    name = local("def hook(context):\n    return context\n")
    _, config = _config(tmp_path, f"imports: [{name}]\nhooks:\n  after_training: !pyobject {name}.hook\n")
    assert unison.recipe.planning.resolved.resolve(config).after_training(3) == 3
    _, config = _config(tmp_path, "imports: [os]\nhooks:\n  after_training: !pyobject os.system\n")
    with pytest.raises(ConfigError) as info:
        unison.recipe.planning.resolved.resolve(config)
    assert info.value.key_path == "imports.0" and "standard library" in str(info.value)
