"""The config's JSON Schema (draft 2020-12), made from the schema's dataclasses, for editors.

YAML language servers check a config against it and complete its keys: each key is a
property with its ``description`` (the key's line of documentation), its ``default`` and
its type (``Literal`` an ``enum``, ``X | None`` nullable, a section an object with no
other keys, an old name a ``deprecated`` property). A ``!pyobject`` key is a string: JSON
Schema never sees YAML tags, and an editor told of the tag reads ``!pyobject a.b`` as the
string ``a.b``. What the schema cannot say (ranges, keys that depend on each other,
whether a ``!pyobject`` fits its key) ``unison config --check`` and ``unison run`` check.

It follows the rules the loader (:mod:`unison.config.validation`) reads the same
declarations with, so a config the loader accepts is valid: a section may be written
empty (null, read as ``{}``); a key declared ``any_case`` takes its values in any case; a
section with ``EXTRA_KEYS`` keeps keys it does not define (when its ``EXTRA_KEYS_WITH``
key is true, as ``model.from_config``); ``data.build`` may be replaced by any key of
:data:`~unison.config.data_config.INSTEAD_OF_BUILD`. ``tests/config/test_json_schema.py``
holds every config of ``recipes/`` and of the loader's tests to it.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from typing import Any, Literal, Union

from unison.config.checks_base import literal_strings
from unison.config.data_config import INSTEAD_OF_BUILD
from unison.config.loader import PyObjectRef
from unison.config.origin import KeyPath
from unison.config.resolve import SLOTS
from unison.config.schema import REQUIRED, Config, _is_section
from unison.config.schema_walk import SchemaKey, section_keys

DIALECT = "https://json-schema.org/draft/2020-12/schema"
"""The JSON Schema draft the schema is written in."""

PYOBJECT_NOTE = (
    "A `!pyobject dotted.path` (YAML tag): JSON Schema does not see tags, so this checks the path as a "
    'string; tell the editor of the tag (YAML language server: `yaml.customTags: ["!pyobject scalar"]`).'
)
"""What the description of every ``!pyobject`` key adds."""

ALTERNATIVES: dict[KeyPath, tuple[str, ...]] = {("data", "build"): INSTEAD_OF_BUILD}
"""Required keys another key of their section can stand in for (data.files or data.stream, for data.build)."""

_SCALARS: dict[Any, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    type(None): "null",
}


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a run's config, read from :mod:`unison.config.schema` now (a key added there is in it).

    Example:
        >>> schema = json_schema()
        >>> schema["properties"]["training"]["properties"]["amp"]["enum"]
        ['none', 'bf16', 'fp16']
    """
    return {
        "$schema": DIALECT,
        "title": "unison run config",
        "description": "A config for `unison run`, `unison tune` and `unison config` (docs/configuration.md).",
        **_section(Config, ()),
    }


def json_schema_text() -> str:
    """:func:`json_schema` as indented JSON text, ending in a newline."""
    return json.dumps(json_schema(), indent=2) + "\n"


def type_schema(tp: Any, path: KeyPath = ()) -> dict[str, Any]:
    """The JSON Schema of the key type ``tp`` (an annotation of the schema); ``{}`` (anything) for a type it
    has no rule for, and for ``Any``."""
    origin = typing.get_origin(tp)
    if _is_section(tp):
        return _section(tp, path)
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is PyObjectRef:
        return {"type": "string"}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (Union, types.UnionType):
        return _union([type_schema(a, path) for a in typing.get_args(tp)])
    if origin is dict:
        value = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        out: dict[str, Any] = {"type": "object"}
        if value is not Any:
            out["additionalProperties"] = type_schema(value, path)
        return out
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        out = {"type": "array"}
        if len(set(args)) == 1 and args[0] is not Any:
            out["items"] = type_schema(args[0], path)
        return out
    return {}


def _union(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One schema for ``A | B``: plain types as a list of types, enums joined, else ``anyOf``."""
    if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
        names = list(dict.fromkeys(p["type"] for p in parts))  # PyObjectRef | str: one "string"
        return {"type": names[0] if len(names) == 1 else names}
    enums = [p for p in parts if set(p) == {"enum"}]
    if len(enums) == len(parts) - 1 and {"type": "null"} in parts:  # Literal[...] | None
        return {"enum": [*enums[0]["enum"], None]}
    return {"anyOf": parts}


def _section(cls: type, path: KeyPath) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    required = sorted({p[len(path)] for p in REQUIRED if p[: len(path)] == path and len(p) > len(path)})
    for key in section_keys(cls, path):
        name = key.path[-1]
        prop = _property(key, required=name in required)
        properties[name] = prop
        if key.alias:
            properties[key.alias] = {
                **prop,
                "description": f"The old name of `{name}`, still read: {prop['description']}",
                "deprecated": True,
            }
    out: dict[str, Any] = {"type": "object", "properties": properties}
    extra = getattr(cls, "EXTRA_KEYS", None)  # a section the loader lets keep keys it does not define
    gate = getattr(cls, "EXTRA_KEYS_WITH", None)
    if extra is None:
        out["additionalProperties"] = False
    elif gate is not None:  # only with ``gate: true``; else its own keys alone
        out["if"] = {"properties": {gate: {"const": True}}, "required": [gate]}
        out["else"] = {"propertyNames": {"enum": list(properties)}}
    plain = [name for name in required if path + (name,) not in ALTERNATIVES]
    if plain:
        out["required"] = plain
    either = [[name, *ALTERNATIVES[path + (name,)]] for name in required if path + (name,) in ALTERNATIVES]
    if either:  # one of them
        out["allOf"] = [{"anyOf": [{"required": [name]} for name in names]} for names in either]
    return out


def _property(key: SchemaKey, required: bool) -> dict[str, Any]:
    schema = type_schema(key.type, key.path)
    if key.is_section:  # written empty (null), the loader reads it as {}
        schema = {**schema, "type": ["object", "null"]}
    if key.any_case:  # the loader reads "info" as "INFO"
        schema = {
            "anyOf": [schema, {"type": "string", "pattern": _any_case_pattern(literal_strings(key.type))}]
        }
    notes = [key.doc]
    if key.slot is not None:
        if key.slot in SLOTS:
            notes.append(f"Accepts {SLOTS[key.slot].accepts}")
        notes.append(PYOBJECT_NOTE)
    required = required and key.path not in ALTERNATIVES  # with an alternative, null is a fine value
    if required:  # null is its default, and an error: a run needs it
        notes.append("Required")
        schema = _not_null(schema)
    description = " ".join(n if n.endswith(".") or len(notes) == 1 else n + "." for n in notes if n)
    prop: dict[str, Any] = {"description": description, **schema}
    if not key.is_section and not required:
        default = _json_value(key.default)
        if default is not _NO_VALUE:
            prop["default"] = default
    return prop


def _any_case_pattern(values: list[str]) -> str:
    """A pattern (ECMA 262, as editors run it) matching ``values`` in any case: ``[Ii][Nn][Ff][Oo]``."""
    spelled = (
        "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in v) for v in values
    )
    return "^(?:" + "|".join(spelled) + ")$"


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    if isinstance(schema.get("type"), list):
        kept = [t for t in schema["type"] if t != "null"]
        return {**schema, "type": kept[0] if len(kept) == 1 else kept}
    if "anyOf" in schema:
        return _union([p for p in schema["anyOf"] if p != {"type": "null"}])
    return schema


_NO_VALUE = object()


def _json_value(value: Any) -> Any:
    """``value`` as JSON (a ``!pyobject`` as its path), or ``_NO_VALUE`` when JSON has no way to write it."""
    if isinstance(value, PyObjectRef):
        return value.path
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return _NO_VALUE if any(v is _NO_VALUE for v in items) else items
    if isinstance(value, dict):
        pairs = {str(k): _json_value(v) for k, v in value.items()}
        return _NO_VALUE if any(v is _NO_VALUE for v in pairs.values()) else pairs
    if isinstance(value, float) and not math.isfinite(value):
        return _NO_VALUE
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _NO_VALUE
