"""YAML configs: a safe loader with ``!pyobject``, a typed schema, overrides and resolution."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from unison.config.errors import ConfigError
from unison.config.loader import PyObjectRef, RawConfig, UnisonLoader, load_yaml
from unison.config.origin import Origin
from unison.config.overrides import apply_overrides
from unison.config.reference import schema_reference
from unison.config.resolve import ALLOWED_PREFIXES, DENIED_PREFIXES, resolve_ref, resolve_tree
from unison.config.schema import Config
from unison.config.validation import validate

__all__ = [
    "ALLOWED_PREFIXES",
    "DENIED_PREFIXES",
    "Config",
    "ConfigError",
    "Origin",
    "PyObjectRef",
    "RawConfig",
    "UnisonLoader",
    "apply_overrides",
    "dump_config",
    "load_config",
    "load_yaml",
    "resolve_ref",
    "resolve_tree",
    "schema_reference",
    "to_plain",
    "validate",
]


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Config:
    """Reads, overrides and validates a config file. Nothing is imported or called.

    Raises:
        ConfigError: naming the file, line and key path of the first problem.
    """
    raw = apply_overrides(load_yaml(path), list(overrides or []))
    config = validate(raw)
    config.origin = dataclasses.replace(raw.origin, file=str(Path(path).resolve()))  # for errors found later
    return config


def to_plain(value: Any) -> Any:
    """A config (or part of one) as plain data: references become ``"!pyobject path"`` strings.

    This is what a checkpoint stores: data that is never resolved back into objects.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, PyObjectRef):
            return str(value)
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


class _Dumper(yaml.SafeDumper):
    pass


def _represent_ref(dumper: yaml.SafeDumper, ref: PyObjectRef) -> yaml.Node:
    return dumper.represent_scalar("!pyobject", ref.path)


_Dumper.add_representer(PyObjectRef, _represent_ref)


def _read_as_the_loader_does(dumper: type[yaml.SafeDumper]) -> None:
    """Quotes every string :class:`UnisonLoader` would read as another type (YAML 1.2's ``1e3``, a float),
    as well as those YAML 1.1 readers would (``yes``): a dumped config loads back with its strings."""
    for first, resolvers in list(UnisonLoader.yaml_implicit_resolvers.items()):
        for tag, pattern in resolvers:
            dumper.add_implicit_resolver(tag, pattern, [first])


_read_as_the_loader_does(_Dumper)


def dump_config(config: Config) -> str:
    """The resolved config (every default filled in) as YAML that :func:`load_config` reads back."""

    def plain(value: Any) -> Any:
        if isinstance(value, PyObjectRef):
            return PyObjectRef(value.path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    # never folded: a line-wise reader (the masking of URL passwords) sees each value whole
    return yaml.dump(plain(config), Dumper=_Dumper, sort_keys=False, width=2**31 - 1)
