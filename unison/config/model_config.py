"""``model``: which model a run builds, with what arguments, and how it is called on a batch.

A section of the schema (:mod:`unison.config.schema`), in a module of its own. Its fields
carry the same metadata as :func:`~unison.config.schema.option`'s, for the reference page.
Three ways to build the model, one per config:

- ``type(*args, **kwargs)``: a model class (or a function of the user's returning a
  model) with positional ``args`` and keyword ``kwargs``; their items may name classes
  and functions with ``!pyobject`` (a graph convolution class, a pooling function);
- ``type.from_config(config)`` with ``from_config: true``: a classmethod that reads one
  nested mapping, as QuantumGrav's ``GNNModel.from_config(config["model"])`` does. The
  mapping is ``model.config`` plus every key of the section that is not one of unison's
  (QuantumGrav writes them straight under ``model:``).

``call`` says how the model is called on a batch (:class:`~unison.engine.ModelCall`,
:class:`~unison.engine.AutoCall`). :func:`check_model` checks the section's values; it runs
inside :func:`~unison.config.validate`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from unison.config.loader import PyObjectRef, RawConfig

NESTED_KEYS = "config"
"""The field that collects the section's keys that are not unison's (read by ``from_config``)."""


def _key(default: Any, doc: str, slot: str | None = None) -> Any:
    metadata = {"doc": doc, "alias": None, "slot": slot}
    if isinstance(default, (dict, list)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    EXTRA_KEYS = NESTED_KEYS  # validation puts keys the section does not define here
    EXTRA_KEYS_WITH = "from_config"  # ... and check_model refuses them unless this key is true

    type: PyObjectRef | str | None = _key(
        None,
        'the model class (or a function returning a model): !pyobject, or a name ("GNNModel") found in '
        "the modules under imports:",
        slot="model",
    )
    args: list[Any] = _key(
        [],
        "positional arguments of the model: values, lists, mappings, and !pyobject classes and functions "
        "(a torch.nn.Module class of torch or an installed library, e.g. torch_geometric.nn.conv.SAGEConv; "
        "a function of a library's nn package, e.g. torch_geometric.nn.global_mean_pool)",
    )
    kwargs: dict[str, Any] = _key({}, "keyword arguments of the model (values as in args)")
    from_config: bool = _key(
        False,
        "build the model with type.from_config(<model.config and the section's other keys, as one mapping>), "
        "a classmethod reading nested keys (QuantumGrav's GNNModel); args and kwargs stay empty",
    )
    config: dict[str, Any] = _key(
        {},
        "the mapping from_config reads; with from_config: true, keys of this section that are not unison's "
        "are added to it",
    )
    call: list[str | int] | dict[str, str | int] | PyObjectRef | None = _key(
        None,
        "how the model is called on a batch: a list of fields passed by position ([x, edge_index, batch]), a "
        "mapping keyword -> field, or !pyobject fn(model, batch) -> outputs (QuantumGrav's apply_model); null: "
        "a torch_geometric batch as model(x, edge_index, batch), an (x, y) pair as model(x), another batch whole",
        slot="model_call",
    )


def check_model(model: ModelConfig, raw: RawConfig) -> None:
    """Keys the ``model`` section does not define are the model's own, read by ``from_config``;
    without ``from_config: true`` the first is refused with the nearest key of the section.

    Raises:
        ConfigError: naming the file, the line and the key.
    """
    section = ("model",)
    given = raw.data.get("model") if isinstance(raw.data, dict) else None
    own = [f.name for f in fields(ModelConfig)]
    extra = [str(k) for k in (given or {}) if str(k) not in own] if isinstance(given, dict) else []
    if extra and not getattr(model, ModelConfig.EXTRA_KEYS_WITH):
        key = extra[0]
        near = difflib.get_close_matches(key, own, n=1, cutoff=0.6)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise raw.origin.error(
            section + (key,),
            f"unknown key {key!r} in model. Valid keys: {', '.join(sorted(own))}.{hint} Keys read by the model "
            "class itself (QuantumGrav's GNNModel.from_config) need `from_config: true` in this section",
        )
    if model.from_config:
        if model.type is None:
            raise raw.origin.error(
                section + ("from_config",),
                "from_config: true needs model.type, the class whose from_config builds the model "
                "(e.g. `type: !pyobject QuantumGrav.GNNModel`)",
            )
        for name in ("args", "kwargs"):
            if getattr(model, name):
                raise raw.origin.error(
                    section + (name,),
                    f"with from_config: true the model is built by type.from_config(<one mapping>); {name} "
                    "would not be used: move these values into the mapping (model.config or keys of this section)",
                )
    call = model.call
    if isinstance(call, list) and not call:
        raise raw.origin.error(
            section + ("call",), "an empty list calls the model with nothing; leave call out"
        )
    if isinstance(call, dict):
        for name, value in call.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise raw.origin.error(
                    section + ("call", str(name)), f"a keyword name is a word, got {name!r}"
                )
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise raw.origin.error(
                    section + ("call", name),
                    f"expected a field of the batch (a name or a position), got {value!r}",
                )
