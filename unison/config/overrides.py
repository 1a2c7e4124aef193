"""Command-line overrides: ``--set training.lr=3e-4``."""

from __future__ import annotations

import yaml

from unison.config.errors import ConfigError
from unison.config.loader import PyObjectRef, RawConfig, read_value


def apply_overrides(raw: RawConfig, overrides: list[str]) -> RawConfig:
    """Applies ``KEY.PATH=VALUE`` settings to a config read from a file.

    The value is read as YAML (``3e-4`` is a float, ``[1, 2]`` a list, ``null`` None,
    ``!pyobject torch.optim.SGD`` a reference), with the same safe loader as the file.
    Later settings win. The schema then validates the result, and its messages name the
    ``--set`` that gave a bad value.
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"expected KEY.PATH=VALUE, like training.lr=3e-4, got {item!r}", file=f"--set {item}"
            )
        try:
            value = read_value(text, f"--set {item}") if text.strip() else ""
        except ConfigError as err:
            raise ConfigError(err.problem, file=f"--set {item}", key=key.split(".")) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"the value {text!r} is not valid YAML: {err}", file=f"--set {item}") from None
        raw.set(tuple(key.split(".")), _from_command_line(value, item), item)
    return raw


def _from_command_line(value: object, item: str) -> object:
    if isinstance(value, PyObjectRef):
        return PyObjectRef(value.path, f"--set {item}", 0)
    if isinstance(value, dict):
        return {k: _from_command_line(v, item) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_command_line(v, item) for v in value]
    return value
