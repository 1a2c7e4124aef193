"""What each kind of ``!pyobject`` key accepts: the typed slots, and the scope of one config.

Every key that takes a ``!pyobject`` names a slot of :data:`SLOTS`: a description for
messages, a check of the object found, and a fix. :class:`Scope` says which modules are the
user's own (the config's folder and its ``imports:``). :mod:`unison.config.resolve` imports
the object and asks its slot.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.config.usercode import (
    MAIN_MODULES,
    RESERVED,
    folder_package,
    in_stdlib,
    main_problem,
    refused_import,
)

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


def _data_function(obj: Any, via_user: bool, scope: Scope) -> bool:
    """A function of the user's, or a callable object (not a class) their module holds."""
    if _function(obj):
        return scope.is_users(obj)
    return via_user and callable(obj) and not isinstance(obj, (type, types.ModuleType))


def _early_stopping(obj: Any, via_user: bool, scope: Scope) -> bool:
    names = {
        f"{c.__module__}.{c.__qualname__}" for c in getattr(obj, "__mro__", ())
    }  # config imports no handlers
    return isinstance(obj, type) and "unison.handlers.early_stopping.EarlyStopping" in names


def _handler(obj: Any, via_user: bool, scope: Scope) -> bool:
    """A class of the user's own modules whose instances attach themselves or are called at an event."""
    if not isinstance(obj, type) or not scope.is_users(obj):
        return False
    return callable(getattr(obj, "attach", None)) or any("__call__" in vars(c) for c in obj.__mro__[:-1])


def _library_function(obj: Any) -> bool:
    """A function of an installed library's ``nn`` package (``torch_geometric.nn.global_mean_pool``):
    layer helpers, as ``torch.nn.functional``'s are torch's. The standard library has none."""
    module = getattr(obj, "__module__", None)
    if not _function(obj) or not isinstance(module, str):
        return False
    parts = module.split(".")
    return "nn" in parts[1:] and not in_stdlib(parts[0]) and parts[0] not in RESERVED


def _model_arg(obj: Any, via_user: bool, scope: Scope) -> bool:
    return _value(obj, via_user, scope) or _library_function(obj)


def _model_call(obj: Any, via_user: bool, scope: Scope) -> bool:
    return _user_function(obj, via_user, scope) or isinstance(obj, type) and scope.is_users(obj)


def _collate(obj: Any, via_user: bool, scope: Scope) -> bool:
    home = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__name__', '')}"
    return _user_function(obj, via_user, scope) or (_function(obj) and home in COLLATE_FUNCTIONS)


COLLATE_FUNCTIONS = (
    "torch.utils.data._utils.collate.default_collate",
    "torch.utils.data._utils.collate.default_convert",
    "unison.distributed.collate.collate",
)
"""Library functions a ``collate`` key may name besides the user's own."""

LIBRARY_SLOTS = ("model", "model_arg")
"""Slots that take model parts from installed libraries besides torch (torch_geometric's layers):
a ``torch.nn.Module`` subclass, and inside model arguments a function of the library's ``nn``."""


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
        _USER + ": fn(seed[, world_size], **data.kwargs) -> (train, val[, test])",
        _user_function,
        "write `def build(seed, ...)` returning (train, val[, test]) datasets in a module beside the config",
    ),
    "hook": Slot(_USER + ": fn(context)", _user_function, "write the hook in a module beside the config"),
    "data_function": Slot(
        _USER + ", or a callable object one of them holds (a reader, a transform of a file-backed dataset)",
        _data_function,
        "write the function in a module beside the config",
    ),
    "early_stopping": Slot(
        "unison.handlers.EarlyStopping (also named EarlyStopping or DefaultEarlyStopping), or a subclass of it",
        _early_stopping,
        "leave type out for unison's EarlyStopping",
    ),
    "handler": Slot(
        "a handler class of your own modules: instances with attach(engine), or called as handler(engine) at "
        "`event`",
        _handler,
        "write the class in a module beside the config; a handler of unison's or ignite's is attached by "
        "the keys of its section, or from Python",
    ),
    "handler_function": Slot(
        _USER + ": fn(engine, *args, **kwargs), called at `event`",
        _user_function,
        "write the function in a module beside the config",
    ),
    "model_arg": Slot(
        "inside model args and kwargs, what kwargs take (constants, torch.nn.Module classes, functions of "
        "torch.nn.functional and torch.nn.init, objects of your own modules), torch.nn.Module classes of "
        "installed libraries (torch_geometric.nn.conv.SAGEConv), and functions of a library's nn package "
        "(torch_geometric.nn.global_mean_pool)",
        _model_arg,
        "pass plain data, layer classes and layer functions; nothing that runs commands or touches files",
    ),
    "model_call": Slot(
        _USER + ": fn(model, batch) -> outputs (QuantumGrav's apply_model)",
        _model_call,
        "or give a list of the batch's fields, e.g. `call: [x, edge_index, batch]`",
    ),
    "collate": Slot(
        _USER + ": fn(items) -> batch, or torch.utils.data.default_collate",
        _collate,
        "leave it out for torch_geometric's collate on graphs and torch's default_collate otherwise",
    ),
    "batch": Slot(
        _USER + ": fn(batch, device) -> (inputs, target)",
        _user_function,
        "or give `batch: {target: y}` to keep the batch whole and take its target field",
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
