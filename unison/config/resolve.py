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

import enum
import importlib
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.config.errors import ConfigError
from unison.config.loader import PyObjectRef
from unison.config.usercode import (
    MAIN_FIX,
    MAIN_MODULES,
    RESERVED,
    describe,
    folder_package,
    in_stdlib,
    local_module,
    main_problem,
    public_module,
    refused_import,
)

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

_USER = "a function of your own modules (files beside the config, or modules under `imports:`)"


@dataclass(frozen=True)
class Scope:
    """Where one config's references come from: its folder and its ``imports:``."""

    imports: tuple[str, ...] = ()
    config_dir: Path | None = None

    def user_packages(self) -> tuple[str, ...]:
        """Module names whose functions are the user's own."""
        own = [entry for entry in self.imports if refused_import(entry, self.config_dir) is None]
        if self.config_dir is not None:
            own.append(folder_package(self.config_dir))
        return tuple(own)

    def is_users(self, obj: Any) -> bool:
        """Whether ``obj`` (a function or class) is defined in one of the user's own modules."""
        module = getattr(obj, "__module__", None)
        if module in MAIN_MODULES:  # the user's script, run through unison's Python API
            return main_problem() is None
        return isinstance(module, str) and any(_under(module, p) for p in self.user_packages())


@dataclass(frozen=True)
class Slot:
    """What one kind of key accepts: a description for messages, a check, and a fix."""

    accepts: str
    check: Callable[[Any, bool, Scope], bool]
    fix: str = ""


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return path == prefix or path.startswith(prefix + ".")


def _function(obj: Any) -> bool:
    return isinstance(obj, (types.FunctionType, types.BuiltinFunctionType))


def _subclass(obj: Any, *bases: type) -> bool:
    return isinstance(obj, type) and issubclass(obj, bases)


def _module_class(obj: Any) -> bool:
    import torch

    return _subclass(obj, torch.nn.Module)


def _functional(obj: Any) -> bool:
    """A function of ``torch.nn.functional`` (pure tensor functions)."""
    import torch.nn.functional as F

    name = getattr(obj, "__name__", None)
    return (
        _function(obj)
        and isinstance(name, str)
        and getattr(obj, "__module__", None) in ("torch.nn.functional", "torch._C._nn", "torch")
        and getattr(F, name, None) is obj
    )


def _init_function(obj: Any) -> bool:
    return _function(obj) and getattr(obj, "__module__", None) == "torch.nn.init"


def _constant(obj: Any) -> bool:
    import torch

    return isinstance(
        obj,
        (
            bool,
            int,
            float,
            complex,
            str,
            type(None),
            torch.dtype,
            torch.layout,
            torch.memory_format,
            enum.Enum,
        ),
    )


def _model(obj: Any, via_user: bool, scope: Scope) -> bool:
    return _module_class(obj) or (_function(obj) and scope.is_users(obj))


def _optimizer(obj: Any, via_user: bool, scope: Scope) -> bool:
    import torch

    return _subclass(obj, torch.optim.Optimizer)


def _scheduler(obj: Any, via_user: bool, scope: Scope) -> bool:
    from torch.optim import lr_scheduler

    return _subclass(obj, lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)


def _loss(obj: Any, via_user: bool, scope: Scope) -> bool:
    import torch

    return (
        _module_class(obj)
        or _functional(obj)
        or (_function(obj) and scope.is_users(obj))
        or (via_user and isinstance(obj, torch.nn.Module))
    )


METRICS_REFUSED = ("ignite.metrics.gan.fid.FID", "ignite.metrics.gan.inception_score.InceptionScore")
"""Metric classes that download model weights when they are built."""


def _metric(obj: Any, via_user: bool, scope: Scope) -> bool:
    from ignite.metrics import Metric

    return _subclass(obj, Metric) and f"{obj.__module__}.{obj.__qualname__}" not in METRICS_REFUSED


def _user_function(obj: Any, via_user: bool, scope: Scope) -> bool:
    return _function(obj) and scope.is_users(obj)


def _data_function(obj: Any, via_user: bool, scope: Scope) -> bool:  # a user's function, or a callable they hold
    return scope.is_users(obj) if _function(obj) else via_user and callable(obj) and not isinstance(obj, type)


def _early_stopping(obj: Any, via_user: bool, scope: Scope) -> bool:
    names = {f"{c.__module__}.{c.__qualname__}" for c in getattr(obj, "__mro__", ())}  # config imports no handlers
    return isinstance(obj, type) and "unison.handlers.early_stopping.EarlyStopping" in names


def _value(obj: Any, via_user: bool, scope: Scope) -> bool:
    if isinstance(obj, types.ModuleType):
        return False
    if isinstance(obj, type) or _function(obj):
        return _module_class(obj) or _functional(obj) or _init_function(obj) or scope.is_users(obj)
    return _constant(obj) or via_user


SLOTS: dict[str, Slot] = {
    "model": Slot(
        "a torch.nn.Module subclass, or " + _USER + " that returns a model",
        _model,
        "name the model class (e.g. torch.nn.Linear), or write a function in a module beside the config",
    ),
    "optimizer": Slot("a torch.optim.Optimizer subclass", _optimizer, "e.g. `!pyobject torch.optim.AdamW`"),
    "scheduler": Slot(
        "an LR scheduler class (a torch.optim.lr_scheduler.LRScheduler or ReduceLROnPlateau subclass)",
        _scheduler,
        "e.g. `!pyobject torch.optim.lr_scheduler.CosineAnnealingLR`",
    ),
    "loss": Slot(
        "a torch.nn.Module subclass (built with no arguments), a function of torch.nn.functional, "
        "or a loss function or loss module instance of your own modules",
        _loss,
        "e.g. `!pyobject torch.nn.functional.cross_entropy` or `!pyobject torch.nn.CrossEntropyLoss`",
    ),
    "metric": Slot(
        "an ignite.metrics.Metric subclass (unison.metrics or ignite.metrics; not FID or InceptionScore, "
        "which download weights)",
        _metric,
        "e.g. `!pyobject unison.metrics.Accuracy`",
    ),
    "data": Slot(
        _USER + ": fn(seed, **data.kwargs) -> (train, val[, test])",
        _user_function,
        "write `def build(seed, ...)` returning (train, val[, test]) datasets in a module beside the config",
    ),
    "hook": Slot(_USER + ": fn(context)", _user_function, "write the hook in a module beside the config"),
    "data_function": Slot(
        _USER + ", or a callable object one of them holds", _data_function, "write it in a module beside the config"
    ),
    "early_stopping": Slot(
        "unison.handlers.EarlyStopping (also named EarlyStopping or DefaultEarlyStopping), or a subclass of it",
        _early_stopping,
        "leave type out for unison's EarlyStopping",
    ),
    "value": Slot(
        "inside kwargs, a constant (a number, a string, a torch dtype), a torch.nn.Module class, "
        "a function of torch.nn.functional or torch.nn.init, or an object of your own modules",
        _value,
        "pass plain data in kwargs, and name code only in the keys that take it",
    ),
}
"""What each kind of ``!pyobject`` key accepts. The schema's ``slot=`` names one of these."""

_ALIASES = {
    "torch.optim.Optimizer": "optimizer",
    "torch.optim.lr_scheduler.LRScheduler": "scheduler",
    "callable": "hook",
}


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
    obj, via_user = _import(path, scope, fail)
    name = _ALIASES.get(slot or "value", slot or "value")
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


def _import(path: str, scope: Scope, fail: Callable[[str], ConfigError]) -> tuple[Any, bool]:
    parts = path.split(".")
    top = parts[0]
    local = local_module(top, scope.config_dir)
    if top in RESERVED:
        base, via_user = top, False
    elif top == "__main__":
        why = main_problem()
        if why is not None:
            raise fail(f"!pyobject {path}: {why}. {MAIN_FIX.format(name=parts[-1])}")
        base, via_user = top, True
    elif local is not None:
        base, via_user = local, True
    else:
        entries = [entry for entry in scope.imports if _under(path, entry)]
        for entry in entries:
            why = refused_import(entry, scope.config_dir)
            if why is not None:
                raise fail(f"!pyobject {path}: `imports: [{entry}]` is refused: {why}")
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
        base, via_user = top, True

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


def resolve_tree(value: Any, *, key: str, imports: Iterable[str], config_dir: Path | None) -> Any:
    """Resolves every reference inside nested kwargs (lists and mappings) as a value.

    Inside kwargs a ``!pyobject`` may name only what the ``"value"`` slot accepts
    (:data:`SLOTS`): constants, ``torch.nn.Module`` classes, functions of
    ``torch.nn.functional`` and ``torch.nn.init``, and objects of the user's own modules.
    """
    if isinstance(value, PyObjectRef):
        return resolve_ref(value, slot="value", key=key, imports=imports, config_dir=config_dir)
    if isinstance(value, dict):
        return {
            k: resolve_tree(v, key=f"{key}.{k}", imports=imports, config_dir=config_dir)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [
            resolve_tree(v, key=f"{key}.{i}", imports=imports, config_dir=config_dir)
            for i, v in enumerate(value)
        ]
    return value
