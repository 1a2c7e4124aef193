"""The threat model of a config (docs/configuration.md, "What a config can and cannot do").

Cases that fit the bad-config pattern (every bad config fails before any spawn) are in
``test_bad_configs.py`` (``THREAT_CASES``); here are the ones that need more than a file:
shadowing modules, YAML bombs refused before anything is built, ranks re-resolving, and the defaults.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import unison
import unison.recipe.build.preflight
import unison.recipe.planning.resolved
from unison.config import ConfigError, apply_overrides, load_config, load_yaml
from unison.config.loader import UnisonLoader
from unison.recipe.planning.run_plan import plan

ROOT = Path(unison.__file__).resolve().parents[1]  # the subprocesses import this checkout

DATA_MODULE = """\
import jinja2
import torch
import tqdm
from torch.utils.data import TensorDataset


def build(seed, n=8):
    ds = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    return ds, ds


def model(width=4):
    return torch.nn.Linear(width, 2)


def not_a_model(width=4):
    return "a string"


TQDM_FILE = tqdm.__file__
JINJA2_FILE = jinja2.__file__
"""


def _config(folder, body: str = "", module: str = "mycode"):
    (folder / f"{module}.py").write_text(DATA_MODULE)
    path = folder / "c.yaml"
    path.write_text(
        "model:\n  type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 4, out_features: 2}\n"
        f"data:\n  build: !pyobject {module}.build\n" + body
    )
    return path


# -- 3. modules beside the config do not shadow installed ones --------------------------------


def test_a_tqdm_py_beside_the_config_does_not_replace_tqdm(tmp_path):
    """In a fresh interpreter: the config's folder holds tqdm.py, jinja2.py and torch.py that
    exit if imported. Resolving imports the user's module, which imports the real jinja2 and
    tqdm, and a later import of tqdm (as in a fresh rank) still finds the installed one."""
    for name in ("tqdm", "jinja2", "torch"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the config folder shadowed {name}')\n")
    path = _config(tmp_path)
    code = textwrap.dedent(
        f"""
        import sys
        from unison.config import load_config
        from unison.recipe.planning.resolved import resolve
        r = resolve(load_config({str(path)!r}))
        module = sys.modules[r.data_build.__module__]
        assert module.__file__ == {str(tmp_path / "mycode.py")!r}
        assert "site-packages" in module.JINJA2_FILE, module.JINJA2_FILE
        del sys.modules["tqdm"]
        import tqdm
        assert "site-packages" in tqdm.__file__ and module.TQDM_FILE == tqdm.__file__, tqdm.__file__
        assert len(r.data_build(seed=0)[0]) == 8
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


def test_modules_beside_the_config_import_each_other_by_plain_name(tmp_path):
    """``import helpers`` in the user's module finds helpers.py beside it (after everything
    installed), as the one module, not a second copy with other classes."""
    (tmp_path / "helpers.py").write_text("SIZE = 8\n")
    (tmp_path / "shapes.py").write_text(
        "import helpers\nfrom helpers import SIZE\n\n\ndef build(seed):\n    return list(range(SIZE)), []\n"
    )
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 4, out_features: 2}\n"
        "data:\n  build: !pyobject shapes.build\n"
    )
    code = textwrap.dedent(
        f"""
        import sys
        from unison.config import load_config
        from unison.recipe.planning.resolved import resolve
        r = resolve(load_config({str(path)!r}))
        assert len(r.data_build(seed=0)[0]) == 8
        shapes = sys.modules[r.data_build.__module__]
        assert shapes.helpers is sys.modules["helpers"] and shapes.helpers.__name__.endswith(".helpers")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


def test_every_process_gets_the_same_private_module_name(tmp_path):
    """Ranks re-resolve the config: the module beside it has one name in every process, which
    a fresh interpreter imports back (as unpickling an object of the user's would)."""
    path = _config(tmp_path)
    resolved = unison.recipe.planning.resolved.resolve(load_config(path))
    name = resolved.data_build.__module__
    assert name.startswith("unison.config.usercode.f") and name.endswith(".mycode")
    code = f"import importlib; m = importlib.import_module({name!r}); print(m.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == str(tmp_path / "mycode.py"), result.stderr
    again = unison.recipe.planning.resolved.resolve(load_config(path))
    assert again.data_build is resolved.data_build


def test_a_module_beside_the_config_is_named_without_imports_and_its_function_checked(tmp_path):
    path = _config(tmp_path, module="mycode2")
    text = path.read_text().replace(
        "type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 4, out_features: 2}",
        "type: !pyobject mycode2.not_a_model",
    )
    path.write_text(text)
    resolved = unison.recipe.planning.resolved.resolve(load_config(path))
    with pytest.raises(ConfigError, match="returned a str"):
        resolved.model_type()
    with pytest.raises(ConfigError, match=r"c.yaml:2: model.type: .*returned a str"):
        unison.recipe.build.preflight.preflight(plan(load_config(path), resolved))


# -- 4. YAML bombs: refused, naming the file, in well under a second --------------------------

BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    "text, needle",
    [
        pytest.param(BILLION_LAUGHS, "alias bomb", id="billion-laughs"),
        pytest.param("a: &a [*a]\n", "recursive", id="recursive-alias"),
        pytest.param("a: &a {b: *a}\n", "recursive", id="recursive-alias-mapping"),
        pytest.param("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "deeper than", id="deep-flow"),
        pytest.param("".join(" " * i + "k:\n" for i in range(0, 200)), "deeper than", id="deep-block"),
        pytest.param("a: '" + "x" * (2 << 20) + "'\n", "bytes", id="too-big"),
    ],
)
def test_yaml_bombs_are_refused_quickly(text, needle, tmp_path, monkeypatch):
    """Refused before any value is built, having scanned a bounded prefix of the document
    (counted, not timed: the deep one holds 200,000 brackets, the scanner reads ~1,100 tokens)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    counts = {"tokens": 0, "built": 0}
    fetch, build = UnisonLoader.fetch_more_tokens, UnisonLoader.construct_object

    def counted_fetch(self):
        counts["tokens"] += 1
        return fetch(self)

    def counted_build(self, node, deep=False):
        counts["built"] += 1
        return build(self, node, deep)

    monkeypatch.setattr(UnisonLoader, "fetch_more_tokens", counted_fetch)
    monkeypatch.setattr(UnisonLoader, "construct_object", counted_build)
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    assert counts["built"] == 0 and counts["tokens"] <= 2_000, counts
    assert str(info.value).startswith(str(path)) and needle in str(info.value), str(info.value)


@pytest.mark.timeout(5)
def test_a_bomb_in_a_set_value_is_refused(tmp_path):
    raw = load_yaml(_config(tmp_path))
    value = "[" + ",".join(["&a [1,1,1,1,1,1,1,1,1]"] + ["*a"] * 3) + "]"
    assert apply_overrides(raw, [f"data.kwargs.x={value}"]).data["data"]["kwargs"]["x"][1] == [1] * 9
    bomb = BILLION_LAUGHS.replace("\n", ", ").replace(": &", ": &").rstrip(", ")
    with pytest.raises(ConfigError, match="alias bomb") as info:
        apply_overrides(raw, [f"data.kwargs.x={{{bomb}}}"])
    assert str(info.value).startswith("--set data.kwargs.x=")


def test_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("base: &b {lr: 1, seed: 2}\nother:\n  <<: *b\n  lr: 3\n")
    assert load_yaml(path).data["other"] == {"lr": 3, "seed": 2}


# -- 7. defaults that pick the best model ---------------------------------------------------


@pytest.mark.parametrize(
    "body, checkpoint_mode, es_mode",
    [
        ("", "min", None),  # no metrics: the loss is watched
        ("validation:\n  metrics:\n    acc: !pyobject unison.metrics.Accuracy\n", "max", None),
        ("validation:\n  metrics:\n    mse: !pyobject unison.metrics.MeanSquaredError\n", "min", None),
        (
            "validation:\n  metrics:\n    acc: !pyobject unison.metrics.Accuracy\n"
            "    val_loss: !pyobject unison.metrics.Loss\n"
            "early_stopping:\n  patience: 2\n  metric: val_loss\n",
            "max",
            "min",
        ),
        ("validation:\n  metrics:\n    score: !pyobject unison.metrics.Accuracy\n", "max", None),
    ],
)
def test_the_mode_follows_the_watched_metric(body, checkpoint_mode, es_mode, tmp_path):
    """The plan derives the modes; validation writes none into the config (a mode left out stays out)."""
    config = load_config(_config(tmp_path, body))
    assert (config.checkpoint.mode, config.early_stopping.mode) == (None, None)
    watched = plan(config).watched
    assert watched.mode == checkpoint_mode
    assert watched.stop_mode == (es_mode or checkpoint_mode)


# -- 1 and 8: what the slots accept, built before spawn ---------------------------------------


def test_a_loss_module_class_is_built_with_no_arguments(tmp_path):
    config = load_config(_config(tmp_path, "training:\n  loss: !pyobject torch.nn.CrossEntropyLoss\n"))
    resolved = unison.recipe.planning.resolved.resolve(config)
    assert isinstance(resolved.loss, torch.nn.CrossEntropyLoss)


def test_preflight_builds_nothing_real_and_calls_no_data_builder(tmp_path):
    path = _config(tmp_path, "logging:\n  root: " + str(tmp_path / "runs") + "\n")
    code = path.parent / "mycode.py"
    code.write_text(
        code.read_text().replace("def build(seed, n=8):", "def build(seed, n=8):\n    raise SystemExit(3)")
    )
    config = load_config(path)
    unison.recipe.build.preflight.preflight(plan(config))
    assert not (tmp_path / "runs").exists()


def test_a_kwargs_typo_from_the_command_line_names_the_set(tmp_path):
    config = load_config(_config(tmp_path), ["model.kwargs.out_feature=3"])
    with pytest.raises(ConfigError) as info:
        unison.recipe.planning.resolved.resolve(config)
    assert str(info.value).startswith("--set model.kwargs.out_feature=3: model.kwargs.out_feature: ")
