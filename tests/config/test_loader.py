"""unison/config/loader.py: safe YAML with an inert ``!pyobject``, and the line of every key."""

from __future__ import annotations

import sys
import uuid

import pytest
import yaml

import unison.config
from unison.config import ConfigError, PyObjectRef, UnisonLoader, load_config, load_yaml


def _line_of(text: str, needle: str) -> int:
    (line,) = [i for i, row in enumerate(text.splitlines(), 1) if needle in row]
    return line


TEXT = """\
name: demo
training:
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs:
    lr: 0.1
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 3, out_features: 1}
imports:
  - json
  - math
"""


def test_pyobject_is_an_inert_reference_with_its_file_and_line():
    raw = load_yaml("demo.yaml", text=TEXT)
    ref = raw.data["training"]["optimizer_type"]
    assert ref == PyObjectRef("torch.optim.SGD", "demo.yaml", _line_of(TEXT, "optimizer_type"))
    assert (ref.file, ref.line) == ("demo.yaml", _line_of(TEXT, "optimizer_type"))
    assert str(ref) == "!pyobject torch.optim.SGD"
    assert raw.data["model"]["type"].path == "torch.nn.Linear"


def test_line_map_covers_nested_keys_and_list_items():
    raw = load_yaml("demo.yaml", text=TEXT)
    assert raw.origin.lines[("name",)] == 1
    assert raw.origin.lines[("training", "optimizer_kwargs", "lr")] == _line_of(TEXT, "lr: 0.1")
    assert raw.origin.lines[("model", "kwargs", "in_features")] == _line_of(TEXT, "in_features")
    assert raw.origin.lines[("imports", "1")] == _line_of(TEXT, "- math")
    # A key that is not in the file takes the line of its nearest ancestor that is.
    assert raw.origin.line_of(("training", "batch_size")) == _line_of(TEXT, "training:")
    assert raw.origin.line_of(("parallel", "backend")) is None
    assert raw.origin.file_of(("training", "lr")) == "demo.yaml"


def test_empty_file_is_an_empty_mapping(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing but a comment\n")
    raw = load_yaml(path)
    assert raw.data == {} and raw.origin.file == str(path)


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "not found" in str(info.value)


@pytest.mark.parametrize(
    "text, needle",
    [
        pytest.param("- a\n- b\n", "list", id="list"),
        pytest.param("just a string\n", "str", id="scalar"),
        pytest.param("!pyobject torch.nn.Linear\n", "PyObjectRef", id="pyobject"),
    ],
)
def test_a_document_that_is_not_a_mapping_is_refused(text, needle):
    with pytest.raises(ConfigError) as info:
        load_yaml("top.yaml", text=text)
    assert str(info.value).startswith("top.yaml:1: ")
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:builtins.open [BAIT, w]",
        "!!python/object/new:builtins.open [BAIT, w]",
        "!!python/name:os.system",
        "!!python/module:os",
        "!!python/object:pathlib.Path {}",
    ],
)
def test_python_tags_are_refused_and_never_run(tag, tmp_path):
    bait = tmp_path / "bait.txt"
    text = f"name: ok\ntraining:\n  loss: {tag.replace('BAIT', str(bait))}\n"
    with pytest.raises(ConfigError) as info:
        load_yaml("tags.yaml", text=text)
    assert str(info.value).startswith(f"tags.yaml:{_line_of(text, 'loss:')}: ")
    assert "Python tags are refused" in str(info.value)
    assert not bait.exists()


def test_unknown_custom_tags_are_refused():
    with pytest.raises(ConfigError) as info:
        load_yaml("t.yaml", text="a: 1\nb: !include other.yaml\n")
    assert str(info.value).startswith("t.yaml:2: ")


def test_pyobject_on_a_sequence_is_refused():
    with pytest.raises(ConfigError) as info:
        load_yaml("t.yaml", text="a: 1\nb: !pyobject [torch, nn]\n")
    assert str(info.value).startswith("t.yaml:2: ")
    assert "dotted path" in str(info.value)


def test_pyyaml_global_loaders_stay_untouched(tmp_path):
    """unison's tag lives on UnisonLoader only: `yaml.safe_load` elsewhere is unaffected."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject torch.utils.data.random_split\n"
    )
    assert load_config(path).model.type.path == "torch.nn.Linear"  # the tag works here
    assert "!pyobject" in UnisonLoader.yaml_constructors
    for loader in (yaml.SafeLoader, yaml.Loader, yaml.FullLoader, yaml.UnsafeLoader, yaml.BaseLoader):
        assert "!pyobject" not in loader.yaml_constructors, loader.__name__
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.safe_load("x: !pyobject os.system")
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.load("x: !pyobject os.system", Loader=yaml.SafeLoader)  # noqa: S506
    # PyYAML's own implicit typing is unchanged too (stock YAML 1.1 reads 3e-4 as a string).
    assert yaml.safe_load("x: 3e-4") == {"x": "3e-4"}


def test_loading_imports_nothing_until_resolve(tmp_path, monkeypatch):
    """Loading and validating a config neither imports nor calls what it names; resolve()
    imports (and calls nothing)."""
    import unison.recipe.planning.resolved

    name = f"unison_probe_{uuid.uuid4().hex[:10]}"
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    imported, called = tmp_path / "imported", tmp_path / "called"
    (code_dir / f"{name}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(imported)!r}).write_text('yes')\n"
        "def build(seed, **kwargs):\n"
        f"    pathlib.Path({str(called)!r}).write_text('yes')\n"
        "    raise RuntimeError('build must not be called while loading or resolving')\n"
    )
    monkeypatch.syspath_prepend(str(code_dir))  # restores sys.path afterwards
    config_dir = tmp_path / "config"  # not the module's folder: `imports:` allows it
    config_dir.mkdir()
    path = config_dir / "c.yaml"
    path.write_text(
        f"imports: [{name}]\nmodel:\n  type: !pyobject torch.nn.Linear\n  kwargs: {{in_features: 2, out_features: 1}}\n"
        f"data:\n  build: !pyobject {name}.build\n"
    )
    try:
        config = load_config(path, [f"hooks.after_training=!pyobject {name}.build"])
        assert name not in sys.modules
        assert not imported.exists()
        resolved = unison.recipe.planning.resolved.resolve(config)
        assert name in sys.modules and imported.exists()
        assert resolved.data_build is sys.modules[name].build
        assert resolved.after_training is sys.modules[name].build
        assert not called.exists()
    finally:
        sys.modules.pop(name, None)


def test_public_names_are_exported():
    for name in unison.config.__all__:
        assert hasattr(unison.config, name), name
