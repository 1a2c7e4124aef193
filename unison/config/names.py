"""A class named by a plain string (``model.type: "GNNModel"``), found in the user's own modules.

QuantumGrav's configs name their model and early stopping by a string, not a
``!pyobject`` path. :func:`resolve_name` looks such a name up, in this order:

1. names unison knows for the slot (``DefaultEarlyStopping`` is unison's ``EarlyStopping``);
2. a dotted name (``mymodule.GNNModel``) is read as ``!pyobject mymodule.GNNModel``;
3. a plain name is looked for in the modules under ``imports:``, then in ``__main__``
   when that is the user's own script (:func:`~unison.config.usercode.main_problem`).

What is found must fit the key's typed slot, as a ``!pyobject`` must: a string never
reaches further than ``!pyobject`` can, and nothing found is called here.
"""

from __future__ import annotations

import difflib
import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any

from unison.config.errors import ConfigError
from unison.config.loader import PyObjectRef
from unison.config.main_script import main_module
from unison.config.resolve import DENIED_PREFIXES, SLOTS, Scope, lookup
from unison.config.usercode import MAIN_MODULES, local_module, main_problem, public_module, refused_import


def user_modules(scope: Scope) -> list[types.ModuleType]:
    """The modules a plain name is looked for in: ``imports:`` (in order), then the user's script.

    Raises:
        ConfigError: an ``imports:`` entry that cannot be imported (with the import's error).
    """
    modules = []
    for entry in scope.imports:
        if refused_import(entry, scope.config_dir) is not None:
            continue  # refused, with its reason, by the imports check
        top, _, rest = entry.partition(".")
        local = local_module(top, scope.config_dir)
        name = ".".join(p for p in (local or top, rest) if p)
        try:
            modules.append(importlib.import_module(name))
        except Exception as err:
            raise ConfigError(
                f"importing {entry} (under imports:) raised {type(err).__name__}: {err}"
            ) from err
    if main_problem() is None:
        modules.append(main_module())  # the user's script: `--main SCRIPT.py`, or the one running
    return modules


def resolve_name(
    name: str,
    *,
    slot: str,
    key: str,
    scope: Scope,
    known: Mapping[str, str] | None = None,
    fail: Callable[[str], ConfigError] | None = None,
) -> Any:
    """The object a plain-string ``name`` names for the key ``key``, checked against ``slot``.

    Args:
        name: the string from the config.
        slot: the key's slot (:data:`~unison.config.resolve.SLOTS`).
        key: the key path, for messages.
        scope: the config's imports and folder.
        known: names unison gives for this slot, to a ``!pyobject`` path each.
        fail: ``fn(message) -> ConfigError`` at the key's file and line.

    Raises:
        ConfigError: the name is found nowhere (listing what the key could name), in
            several modules as different objects, or as an object of the wrong kind.
    """

    def error(message: str) -> ConfigError:
        return fail(message) if fail is not None else ConfigError(message, key=key.split("."))

    known = dict(known or {})
    if name in known or "." in name:
        path = known.get(name, name)
        try:
            return lookup(PyObjectRef(path), slot=slot, key=key, scope=scope)[0]
        except ConfigError as err:
            raise error(err.problem) from None
    if not name.isidentifier():
        raise error(f"{name!r} is not a name like GNNModel, nor a dotted path like mymodule.GNNModel")
    kind = SLOTS[slot]
    try:
        modules = user_modules(scope)
    except ConfigError as err:
        raise error(err.problem) from None
    found = {}
    for module in modules:
        obj = getattr(module, name, None)
        if obj is not None:
            found[f"{public_module(module.__name__)}.{name}"] = obj
    fitting = {path: obj for path, obj in found.items() if kind.check(obj, True, scope) and not _denied(obj)}
    distinct = {id(obj) for obj in fitting.values()}
    if len(distinct) == 1:
        return next(iter(fitting.values()))
    if len(distinct) > 1:
        raise error(f"{name!r} names different objects in {sorted(fitting)}: write the one you mean, dotted")
    if found:
        path, obj = next(iter(found.items()))
        raise error(f"{name!r} is {path}, which does not fit: {key} accepts {kind.accepts}")
    candidates = sorted(k for k in known if "." not in k) + candidates_in(modules, slot, scope)
    searched = [script_name(m) for m in modules]
    where = f"in {', '.join(searched)}" if searched else "(imports: is empty)"
    listed = ", ".join(candidates) if candidates else "none"
    near = difflib.get_close_matches(name, [c.rpartition(".")[2] for c in candidates], n=1, cutoff=0.5)
    guess = f" Did you mean {near[0]}?" if near else ""
    raise error(
        f"{name!r} is not found {where}. It could name: {listed}.{guess} Add the module that defines it under "
        f"`imports:` (or write `!pyobject mymodule.{name}`)"
    )


def script_name(module: types.ModuleType) -> str:
    """A searched module, for messages: the user's script with its file (``__main__ (train.py)``)."""
    if module.__name__ in MAIN_MODULES and getattr(module, "__file__", None):
        return f"__main__ ({module.__file__})"
    return public_module(module.__name__)


def _denied(obj: Any) -> bool:
    """Whether ``obj`` comes from a module no config may reach (``os``, ``torch.hub`` ...)."""
    home = str(getattr(obj, "__module__", "") or "")
    return any(home == p or home.startswith(p + ".") for p in DENIED_PREFIXES)


def candidates_in(modules: list[types.ModuleType], slot: str, scope: Scope) -> list[str]:
    """The classes defined in ``modules`` that fit ``slot``, as ``module.Name``."""
    kind = SLOTS[slot]
    names = []
    for module in modules:
        for attr, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and not attr.startswith("_")
                and obj.__module__ == module.__name__
                and kind.check(obj, True, scope)
            ):
                names.append(f"{public_module(module.__name__)}.{attr}")
    return sorted(names)
