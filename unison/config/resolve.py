"""Turning ``!pyobject`` references into objects, through an allow-list, with type checks."""

from __future__ import annotations

import importlib
import importlib.util
import re
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from unison.config.errors import ConfigError
from unison.config.loader import PyObjectRef

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


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return path == prefix or path.startswith(prefix + ".")


def _is_local_module(top: str, config_dir: Path | None) -> bool:
    if config_dir is None:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin:
        return False
    location = Path(origin).resolve()
    folder = config_dir.resolve()
    return location.parent == folder or (location.name == "__init__.py" and location.parent.parent == folder)


def resolve_ref(
    ref: PyObjectRef,
    *,
    slot: str | None,
    key: str,
    imports: Iterable[str] = (),
    config_dir: Path | None = None,
) -> Any:
    """Imports the object ``ref`` names, if the allow-list permits, and checks it fits ``slot``.

    Args:
        ref: the reference read from the config.
        slot: what the key takes: ``"torch.optim.Optimizer"``,
            ``"torch.optim.lr_scheduler.LRScheduler"``, ``"model"``, ``"metric"``,
            ``"callable"``, or None for any allowed object.
        key: the key path, for messages.
        imports: extra allowed prefixes (the config's ``imports:``).
        config_dir: the config's folder: modules in it are the recipe's own.

    Raises:
        ConfigError: naming the file, line and key, for a refused, unimportable or
            mistyped reference.
    """

    def fail(message: str) -> ConfigError:
        return ConfigError(message, file=ref.file, line=ref.line or None, key=key.split("."))

    path = ref.path
    if not _DOTTED.match(path):
        raise fail(f"!pyobject {path!r} is not a dotted path like torch.optim.AdamW")
    if any(part.startswith("_") for part in path.split(".")):
        raise fail(f"!pyobject {path}: private names (starting with '_') cannot be named in a config")
    for prefix in DENIED_PREFIXES:
        if _under(path, prefix):
            raise fail(
                f"!pyobject {path} is refused: {prefix!r} can run programs, touch files or load code, "
                "which a config must not do"
            )
    top = path.split(".")[0]
    allowed = list(ALLOWED_PREFIXES) + [p for p in imports]
    if not any(_under(path, p) for p in allowed) and not _is_local_module(top, config_dir):
        raise fail(
            f"!pyobject {path} is outside the allow-list ({', '.join(p.rstrip('.') for p in allowed)}, and "
            "modules in the config's folder). Declare its module under `imports:` at the top level "
            f"of the config, e.g. `imports: [{top}]`"
        )
    obj = _import(path, fail)
    _check_slot(obj, slot, path, fail)
    return obj


def _import(path: str, fail: Any) -> Any:
    parts = path.split(".")
    error: BaseException | None = None
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and not module_name.startswith(err.name):
                raise fail(f"!pyobject {path}: importing {module_name} failed: {err}") from err
            error = err
            continue
        except Exception as err:
            raise fail(
                f"!pyobject {path}: importing {module_name} raised {type(err).__name__}: {err}"
            ) from err
        for j, attr in enumerate(parts[i:], start=i + 1):
            if not hasattr(obj, attr):
                near = [n for n in dir(obj) if not n.startswith("_") and n.lower() == attr.lower()]
                hint = f" Did you mean {'.'.join(parts[:i])}.{near[0]}?" if near else ""
                raise fail(
                    f"!pyobject {path}: {type(obj).__name__} {'.'.join(parts[:i])} has no {attr!r}.{hint}"
                )
            obj = getattr(obj, attr)
            if isinstance(obj, types.ModuleType) and obj.__name__ != ".".join(parts[:j]):
                # torch.os is the os module under another name: the allow-list is about what
                # is reached, not how it is spelled.
                raise fail(
                    f"!pyobject {path} reaches module {obj.__name__} through another module; name it directly"
                )
        home = getattr(obj, "__module__", None)
        if isinstance(home, str):
            for prefix in DENIED_PREFIXES:
                if _under(home, prefix):
                    raise fail(
                        f"!pyobject {path} is {home}.{getattr(obj, '__name__', '?')}, which is refused ({prefix!r})"
                    )
        return obj
    raise fail(f"!pyobject {path}: no module {parts[0]!r} can be imported ({error})")


def _check_slot(obj: Any, slot: str | None, path: str, fail: Any) -> None:
    if slot is None:
        return
    if slot == "callable":
        if not callable(obj):
            raise fail(f"!pyobject {path} is a {type(obj).__name__}, but this key takes a function or class")
        return
    if slot == "model":
        import torch.nn as nn

        if isinstance(obj, type) and not issubclass(obj, nn.Module):
            raise fail(f"!pyobject {path} is a class but not a torch.nn.Module subclass")
        if not callable(obj):
            raise fail(f"!pyobject {path} is not a model class or a function returning a model")
        return
    if slot == "metric":
        from ignite.metrics import Metric

        if not (isinstance(obj, type) and issubclass(obj, Metric)):
            raise fail(f"!pyobject {path} is not a metric class (a unison.metrics or ignite.metrics Metric)")
        return
    module_name, _, cls_name = slot.rpartition(".")
    base = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        what = (
            f"the {type(obj).__name__} {obj!r}" if not isinstance(obj, type) else f"class {obj.__qualname__}"
        )
        raise fail(f"!pyobject {path} is {what}, but this key takes a {slot} subclass")


def resolve_tree(value: Any, *, key: str, imports: Iterable[str], config_dir: Path | None) -> Any:
    """Resolves every reference inside nested kwargs (lists and mappings), slot-free."""
    if isinstance(value, PyObjectRef):
        return resolve_ref(value, slot=None, key=key, imports=imports, config_dir=config_dir)
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
