"""unison/config/json_schema.py: the JSON Schema editors check configs with, made from the schema."""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from unison.config import ConfigError, PyObjectRef, UnisonLoader, dump_config, load_config
from unison.config.json_schema import DIALECT, PYOBJECT_NOTE, json_schema
from unison.config.schema_walk import ITEM, walk_keys

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
CONFIGS = sorted({*ROOT.glob("recipes/**/*.yaml"), *ROOT.glob("recipes/**/*.yml")}) + sorted(
    {*DATA.glob("**/*.yaml"), *DATA.glob("**/*.yml")}
)
"""Every config of the repository's recipes and of the loader's tests, in any folder below them."""


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = json_schema()
    Draft202012Validator.check_schema(schema)  # a valid draft 2020-12 schema
    return Draft202012Validator(schema)


def as_editor_sees(value: Any) -> Any:
    """A config as a YAML language server hands it to JSON Schema: `!pyobject a.b` is the string `a.b`."""
    if isinstance(value, PyObjectRef):
        return value.path
    if isinstance(value, dict):
        return {str(k): as_editor_sees(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_editor_sees(v) for v in value]
    return value


def errors(validator: Draft202012Validator, data: Any) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(as_editor_sees(data))
    ]


def loads(path: Path) -> bool:
    try:
        load_config(path)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_unison_accepts_is_valid(validator, path):
    try:
        data = yaml.load(path.read_text(), Loader=UnisonLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        pytest.skip("not YAML (a test of syntax errors)")
    found = errors(validator, data)
    if loads(path):
        assert not found, found
        resolved = yaml.load(dump_config(load_config(path)), Loader=UnisonLoader)  # noqa: S506
        assert not errors(validator, resolved)  # every key written, null ones included
    elif path.stem in ("unknown_top_level", "top_level_list", "quantumgrav_ddp"):
        assert found  # an unknown section, a list, the guide's block without the required data section


def test_the_schema_rejects_unknown_keys_and_wrong_values(validator):
    base = {"model": {"type": "torch.nn.Linear"}, "data": {"build": "mine.build"}}
    assert not errors(validator, base)
    cases = {
        "an unknown key": {"training": {"max_epoch": 3}},
        "an unknown section": {"trainer": {}},
        "a wrong enum value": {"training": {"amp": "fp8"}},
        "a bool for an int": {"training": {"batch_size": True}},
        "a string for a global batch size": {"validation": {"global_batch_size": "64"}},
        "a string for a number": {"training": {"lr": "fast"}},
        "an unknown key in a mapping form": {"training": {"ema": {"decay": 0.9, "decays": 1}}},
        "null for a required key": {"model": {"type": None}},
    }
    for what, change in cases.items():
        data = copy.deepcopy(base)
        for section, keys in change.items():
            data.setdefault(section, {}).update(keys)
        assert errors(validator, data), what
    for valid in (
        {"training": {"amp": "bf16", "lr": 1, "ema": None}},
        {"training": {"ema": {}, "num_epochs": 2}},
        {"training": {"global_batch_size": 64, "batch_size": None}, "validation": {"global_batch_size": 32}},
        {"testing": {"global_batch_size": 16}},
    ):
        data = copy.deepcopy(base)
        for section, keys in valid.items():
            data.setdefault(section, {}).update(keys)
        assert not errors(validator, data), valid
    assert errors(validator, {"data": {"build": "mine.build"}})  # model.type is required
    assert errors(validator, {"model": {"type": "torch.nn.Linear"}, "data": {}})  # data.build, or files
    assert not errors(
        validator, {"model": {"type": "a.B"}, "data": {"files": ["x.zarr"], "reader": "a.read"}}
    )


def _property(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    node = schema
    for name in path:
        if name == ITEM:  # any item of a list of sections (handlers.<i>.type)
            node = node["items"]
            continue
        if "properties" not in node:  # a key that takes a mapping too: its object form
            node = next(p for p in node["anyOf"] if "properties" in p)
        node = node["properties"][name]
    return node


def test_every_key_of_the_schema_is_a_property_with_its_doc_and_default():
    schema = json_schema()
    assert schema["$schema"] == DIALECT
    keys = list(walk_keys())
    assert len(keys) > 60
    for key in keys:
        prop = _property(schema, key.path)
        assert prop["description"].startswith(key.doc), key.path
        if key.slot:
            assert PYOBJECT_NOTE in prop["description"], key.path
        if typing.get_origin(key.type) is typing.Literal:
            assert prop["enum"] == list(typing.get_args(key.type)), key.path
        if key.alias:
            old = _property(schema, key.path[:-1] + (key.alias,))
            assert old["deprecated"] is True and key.path[-1] in old["description"]
        if "default" in prop:
            default = key.default.path if isinstance(key.default, PyObjectRef) else key.default
            assert prop["default"] == default, key.path
        elif not key.is_section:
            assert key.path == ("model", "type"), key.path  # required: no default
        assert prop.get("anyOf") != [], key.path
        assert prop != {"description": prop["description"]} or key.type is Any, key.path  # a type for each


BASE = "model:\n  type: !pyobject torch.nn.Linear\ndata:\n  build: !pyobject mine.build\n"
"""A config the loader accepts, without importing anything: the cases below change it."""


def _accepted_by_the_loader() -> list[tuple[str, str]]:
    """Configs the loader accepts that a schema made apart from it is likely to refuse: each section
    written empty (YAML null; model and data hold required keys), an enum in another case where the
    loader folds it, the keys a model section keeps for from_config, and each source of data."""
    cases = []
    for key in walk_keys():
        if key.is_section and key.path[0] not in ("model", "data"):
            empty: Any = None
            for name in reversed(key.path):
                empty = {name: empty}
            cases.append((f"{'.'.join(key.path)}: (empty)", yaml.safe_dump(empty)))
    return [
        *cases,
        ("log_level: info", "log_level: info\n"),
        ("log_level: Warning", "log_level: Warning\n"),
        (
            "model: from_config keys",
            "model:\n  type: !pyobject mine.Net\n  from_config: true\n  encoder: [{in: 2, out: 4}]\n  depth: 3\n",
        ),
        (
            "data.stream: files",
            "data:\n  stream:\n    files: [train-*.txt]\n    val_files: [val.txt]\n    reader: !pyobject mine.read\n",
        ),
        ("data.stream: hf_dataset", "data:\n  stream: {hf_dataset: saved, val_split: test}\n"),
        ("data.files", "data:\n  files: [a.zarr]\n  reader: !pyobject mine.read_data\n"),
    ]


def _config(tmp_path: Path, change: str) -> tuple[Path, Any]:
    """BASE with the sections of ``change`` in place of its own: the file and what it holds."""
    data = yaml.load(BASE, Loader=UnisonLoader)  # noqa: S506 - a SafeLoader subclass
    data.update(yaml.load(change, Loader=UnisonLoader))  # noqa: S506
    path = tmp_path / "config.yaml"
    path.write_text(yaml.dump(data, Dumper=_TagDumper, sort_keys=False))
    return path, data


class _TagDumper(yaml.SafeDumper):
    """Writes a PyObjectRef back as its ``!pyobject`` tag."""


_TagDumper.add_representer(PyObjectRef, lambda dumper, ref: dumper.represent_scalar("!pyobject", ref.path))


@pytest.mark.parametrize(
    ("what", "change"), _accepted_by_the_loader(), ids=[c[0] for c in _accepted_by_the_loader()]
)
def test_what_the_loader_accepts_the_schema_accepts(validator, tmp_path, what, change):
    path, data = _config(tmp_path, change)
    load_config(path)  # the loader accepts it
    assert not errors(validator, data), what


def test_keys_a_model_section_keeps_only_with_from_config_are_refused_by_both(validator, tmp_path):
    for change in (
        "model:\n  type: !pyobject mine.Net\n  depth: 3\n",
        "model:\n  type: !pyobject mine.Net\n  from_config: false\n  depth: 3\n",
    ):
        path, data = _config(tmp_path, change)
        with pytest.raises(ConfigError, match="from_config: true"):
            load_config(path)
        assert errors(validator, data), change
