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
from unison.config.schema_walk import walk_keys

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
CONFIGS = sorted(ROOT.glob("recipes/*/config.yaml")) + sorted(DATA.glob("*.yaml"))


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
