"""Turning ``!pyobject`` references into objects, and checking each against its typed slot.

Two questions, asked in this order, before anything a config names is called:

1. **May the module be imported?** Only torch, ignite and unison (always the installed
   ones), modules beside the config (imported by file path, see
   :mod:`unison.config.usercode`), and the user's own modules named under ``imports:``.
2. **Does the object fit the slot?** Every key that takes a ``!pyobject`` declares what it
   accepts (:data:`SLOTS`): a ``torch.nn.Module`` subclass, an optimizer class, a loss, a
   metric class, a function of the user's own modules ... Anything else is refused with
   the key, what was found and what the key accepts.
"""

from __future__ import annotations

import importlib
import re
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from unison.config.errors import ConfigError
from unison.config.loader import PyObjectRef
from unison.config.main_script import main_module, nearest_names
from unison.config.slots import _ALIASES, LIBRARY_SLOTS, SLOTS, Scope, Slot, _subclass, _under
from unison.config.usercode import (
    MAIN_FIX,
    RESERVED,
    describe,
    in_stdlib,
    local_module,
    main_problem,
    public_module,
    refused_import,
    refused_library,
)

__all__ = ["ALLOWED_PREFIXES", "DENIED_PREFIXES", "SLOTS", "Scope", "Slot", "lookup", "resolve_ref", "resolve_tree"]

ALLOWED_PREFIXES = ("torch.", "unison.", "ignite.")
"""Modules a config may always name. A config adds its own under ``imports:``; modules that
live in the config's own folder (a recipe's code) are allowed too."""

DENIED_PREFIXES = (
    "os", "posix", "nt", "sys", "subprocess", "builtins", "shutil", "importlib", "pickle", "marshal",
    "ctypes", "socket", "runpy", "code", "pty", "signal", "multiprocessing", "io", "pathlib", "tempfile",
    "torch.hub", "torch.load", "torch.save", "torch.package", "torch.utils.cpp_extension", "torch.jit.load",
    "torch.ops", "torch.distributed", "torch.multiprocessing", "torch.serialization", "_pickle", "_io",
    "_posixsubprocess", "_thread", "_ctypes",
)  # fmt: skip
"""Never resolved, whatever ``imports:`` says: they run programs, touch files or load code."""

_DOTTED = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

def resolve_ref(
    ref: PyObjectRef,
    *,
    slot: str | None,
    key: str,
    imports: Iterable[str] = (),
    config_dir: Path | None = None,
) -> Any:
    """Imports the object ``ref`` names, if the allow-list permits, and checks it fits ``slot``.

    Nothing is called: the module is imported and the object looked up, then checked
    against the slot (:data:`SLOTS`).

    Args:
        ref: the reference read from the config.
        slot: what the key takes, a name in :data:`SLOTS` (``"model"``, ``"optimizer"``,
            ``"scheduler"``, ``"loss"``, ``"metric"``, ``"data"``, ``"hook"``); None or
            ``"value"`` for a reference inside kwargs.
        key: the key path, for messages.
        imports: the config's ``imports:``: the user's own modules.
        config_dir: the config's folder: modules in it are the user's own.

    Raises:
        ConfigError: naming the file, line and key, for a refused, unimportable or
            mistyped reference.
    """
    obj, _ = lookup(ref, slot=slot, key=key, scope=Scope(tuple(imports), config_dir))
    return obj


def lookup(ref: PyObjectRef, *, slot: str | None, key: str, scope: Scope) -> tuple[Any, bool]:
    """:func:`resolve_ref`, returning also whether the object was reached through a user module."""

    def fail(message: str) -> ConfigError:
        return ConfigError(message, file=ref.file, line=ref.line or None, key=key.split("."))

    path = ref.path
    named = path.removeprefix("__main__.")  # the user's script: see usercode.main_problem
    if not _DOTTED.match(named):
        raise fail(f"!pyobject {path!r} is not a dotted path like torch.optim.AdamW")
    if any(part.startswith("_") for part in named.split(".")):
        raise fail(f"!pyobject {path}: private names (starting with '_') cannot be named in a config")
    for prefix in DENIED_PREFIXES:
        if _under(path, prefix):
            raise fail(
                f"!pyobject {path} is refused: {prefix!r} can run programs, touch files or load code, "
                "which a config must not do"
            )
    name = _ALIASES.get(slot or "value", slot or "value")
    obj, via_user = _import(path, scope, fail, libraries=name in LIBRARY_SLOTS)
    kind = SLOTS[name]
    if not kind.check(obj, via_user, scope):
        fix = f"; {kind.fix}" if kind.fix else ""
        hint = ""
        if name == "data":
            import torch.utils.data

            if _subclass(obj, torch.utils.data.Dataset):
                hint = (
                    " (a Dataset class builds one dataset; data.build returns the train and validation sets)"
                )
        if name == "loss" and isinstance(obj, type):
            hint = " (a loss class that is not a torch.nn.Module: name an instance or a function)"
        raise fail(f"!pyobject {path}: found {describe(obj)}{hint}; {key} accepts {kind.accepts}{fix}")
    return obj, via_user


def _import(
    path: str, scope: Scope, fail: Callable[[str], ConfigError], libraries: bool = False
) -> tuple[Any, bool]:
    parts = path.split(".")
    top = parts[0]
    local = local_module(top, scope.config_dir)
    if top in RESERVED:
        base, via_user = top, False
    elif top == "__main__":
        why = main_problem()
        if why is not None:
            raise fail(f"!pyobject {path}: {why}. {MAIN_FIX.format(name=parts[-1])}")
        try:
            base, via_user = main_module().__name__, True  # `--main SCRIPT.py`: imported as __mp_main__
        except ConfigError as err:
            raise fail(f"!pyobject {path}: {err.problem}") from None
    elif local is not None:
        base, via_user = local, True
    else:
        via_user_library = False
        entries = [entry for entry in scope.imports if _under(path, entry)]
        for entry in entries:
            why = refused_import(entry, scope.config_dir)
            if why is not None:
                raise fail(f"!pyobject {path}: `imports: [{entry}]` is refused: {why}")
        if not entries and libraries and refused_library(top, scope.config_dir) is None:
            entries = [top]  # an installed library's model parts: checked by the slot, never the user's own
            via_user_library = True
        if not entries:
            why = refused_import(top, scope.config_dir)
            if why is not None and not in_stdlib(top):
                raise fail(f"!pyobject {path} is refused: {why}")
            if in_stdlib(top):
                raise fail(
                    f"!pyobject {path} is refused: {top} is in Python's standard library, which a config "
                    "cannot reach. A config names torch, ignite and unison classes, and your own code"
                )
            where = f" ({scope.config_dir})" if scope.config_dir is not None else ""
            raise fail(
                f"!pyobject {path} is outside the allow-list: torch, ignite, unison, modules beside the "
                f"config{where}, and your own modules named under `imports:`. If {top} is your own code, "
                f"add `imports: [{top}]` at the top level of the config"
            )
        base, via_user = top, not via_user_library

    def real(i: int) -> str:
        return ".".join([base, *parts[1:i]])

    error: BaseException | None = None
    for i in range(len(parts), 0, -1):
        module_name = real(i)
        shown = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and not module_name.startswith(err.name):
                raise fail(f"!pyobject {path}: importing {shown} failed: {err}") from err
            error = err
            continue
        except Exception as err:
            raise fail(f"!pyobject {path}: importing {shown} raised {type(err).__name__}: {err}") from err
        for j, attr in enumerate(parts[i:], start=i + 1):
            if not hasattr(obj, attr):
                near = [n for n in dir(obj) if not n.startswith("_") and n.lower() == attr.lower()]
                hint = f" Did you mean {'.'.join(parts[: j - 1])}.{near[0]}?" if near else ""
                if top == "__main__" and j == 2:
                    raise fail(f"!pyobject {path}: {nearest_names(obj, attr)}")
                raise fail(
                    f"!pyobject {path}: {type(obj).__name__} {'.'.join(parts[: j - 1])} has no {attr!r}.{hint}"
                )
            obj = getattr(obj, attr)
            if isinstance(obj, types.ModuleType) and obj.__name__ != real(j):
                # torch.os is the os module under another name: what is reached counts, not how it is spelled
                raise fail(
                    f"!pyobject {path} reaches module {public_module(obj.__name__)} through another module; "
                    "name it directly"
                )
        home = getattr(obj, "__module__", None)
        if isinstance(home, str):
            for prefix in DENIED_PREFIXES:
                if _under(home, prefix):
                    raise fail(
                        f"!pyobject {path} is {home}.{getattr(obj, '__name__', '?')}, which is refused ({prefix!r})"
                    )
        return obj, via_user
    raise fail(f"!pyobject {path}: no module {top!r} can be imported ({error})")


def resolve_tree(
    value: Any, *, key: str, imports: Iterable[str], config_dir: Path | None, slot: str = "value"
) -> Any:
    """Resolves every reference inside nested kwargs (lists and mappings) as a value.

    Inside kwargs a ``!pyobject`` may name only what the ``"value"`` slot accepts
    (:data:`SLOTS`): constants, ``torch.nn.Module`` classes, functions of
    ``torch.nn.functional`` and ``torch.nn.init``, and objects of the user's own modules;
    ``slot="model_arg"`` (model arguments) adds an installed library's layer classes and the
    functions of its ``nn`` package.
    """
    if isinstance(value, PyObjectRef):
        return resolve_ref(value, slot=slot, key=key, imports=imports, config_dir=config_dir)
    if isinstance(value, dict):
        return {
            k: resolve_tree(v, key=f"{key}.{k}", imports=imports, config_dir=config_dir, slot=slot)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [
            resolve_tree(v, key=f"{key}.{i}", imports=imports, config_dir=config_dir, slot=slot)
            for i, v in enumerate(value)
        ]
    return value
