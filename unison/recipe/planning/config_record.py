"""A config as the records a run keeps of it, each computed once in the run's plan.

- :func:`hparams_of`: flat ``section.key`` settings for TensorBoard's HParams dashboard;
- :func:`params_of`: the same as MLflow parameters (text values);
- :func:`config_record`: the plain copy a checkpoint stores, URL credentials masked;
- :func:`config_yaml`: the YAML a run folder's ``config.yaml`` holds, URL credentials masked.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import yaml

from unison.config import Config, PyObjectRef, dump_config, to_plain
from unison.handlers.hparams import HParamValue
from unison.utils.secrets import redact, redact_url

LEFT_OUT = ("tuning",)
"""Sections not written as hparams: ``tuning`` describes a sweep, the same for all its trials."""


def hparams_of(config: Config) -> dict[str, HParamValue]:
    """The config's settings as flat ``section.key`` names: what the HParams dashboard shows.

    Numbers, booleans and strings are kept; a ``!pyobject`` reference is its dotted path;
    mappings (``optimizer_kwargs``, ``model.kwargs``, sections) are flattened into dotted
    names; lists, empty mappings, ``None`` and the sections of :data:`LEFT_OUT` are left out.

    Example:
        >>> from unison.config import Config
        >>> hp = hparams_of(Config())
        >>> hp["training.lr_scaling"], hp["training.optimizer_type"], "training.lr" in hp
        ('none', 'torch.optim.AdamW', False)
    """
    flat: dict[str, HParamValue] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, PyObjectRef):
            flat[name] = value.path
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{name}.{f.name}" if name else f.name)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{name}.{key}")
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value

    for f in dataclasses.fields(config):
        if f.name not in LEFT_OUT:
            walk(getattr(config, f.name), f.name)
    return flat


def params_of(config: Config) -> dict[str, str]:
    """The resolved config as MLflow parameters: dotted keys (``training.lr``), text values;
    ``!pyobject`` references as their dotted path, null as ``null``, lists as JSON."""
    out: dict[str, str] = {}

    def text(value: Any) -> str:
        if value is None or isinstance(value, bool):
            return json.dumps(value)
        if isinstance(value, PyObjectRef):
            return value.path
        if isinstance(value, (list, tuple, dict)):
            return json.dumps(value, default=lambda v: v.path if isinstance(v, PyObjectRef) else str(v))
        return str(value)

    def walk(value: Any, key: str) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, (type, PyObjectRef)):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict) and value:
            for name, item in value.items():
                walk(item, f"{key}.{name}")
        else:
            out[key] = text(value)

    walk(config, "")
    return out


def config_record(config: Config) -> dict[str, Any]:
    """The copy of ``config`` a checkpoint stores for reference: plain values, URL credentials masked."""
    record = redact(to_plain(config))
    assert isinstance(record, dict)
    return record


def config_yaml(config: Config) -> str | None:
    """The config as the YAML a run folder's ``config.yaml`` holds, URL credentials masked; None
    for a config built in Python that holds an object instead of a reference (YAML cannot write
    it: such a config builds a run's parts, and :func:`~unison.recipe.phases.train_from_config`
    refuses it)."""
    try:
        return redact_url(dump_config(config))
    except yaml.YAMLError:
        return None
