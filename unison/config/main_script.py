"""The user's own script named on the command line: ``unison run CONFIG --main SCRIPT.py``.

A config written for a script that loads it (``python train.py``, ``torchrun train.py``)
names that script's functions and classes as ``!pyobject __main__.compute_loss`` and
``model.type: "GNNModel"``. Under ``unison run`` ``__main__`` is unison itself; ``--main``
says which script ``__main__`` stands for. The script is imported the way multiprocessing's
spawn imports a parent's script: as the module ``__mp_main__``, so its
``if __name__ == "__main__":`` block does not run (a script whose training is not behind
that guard would start it on import: nothing checks for that beyond the guard itself).

The script is imported when a config first names something in it, never before: a config
that names nothing there runs as it would without ``--main``. Every rank imports it the
same way: spawned ranks receive its path from the launching process
(:func:`unison.recipe.phases.launch_config`), torchrun and srun ranks read the same ``--main``.
Modules beside the script import by plain name from it, as when Python runs it, but its folder
comes last on ``sys.path``: installed packages always win. Where ``__main__`` is unison itself,
the script also stands in for it (:func:`_stand_in_for_main`), so processes started from a rank
(the worker pool of ``data.n_processes``) import the script too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

from unison.config.errors import ConfigError
from unison.config.usercode import MAIN_SCRIPT, running_main_problem

__all__ = ["MAIN_NAME", "MainScriptError", "main_module", "nearest_names", "script", "use_main"]

MAIN_NAME = "__mp_main__"
"""The module name the script is imported under (the name a spawned rank gives its parent's script)."""


class MainScriptError(ValueError):
    """``--main`` names no Python script; raised before the config is read."""


def use_main(path: str | os.PathLike[str] | None, *, flag: str = "--main") -> Path | None:
    """Makes ``path`` the script ``__main__.<name>`` and plain class names are looked up in, or
    forgets the script (``None``). A relative path is read from the working directory.

    Nothing is imported here (:func:`main_module` imports the script when a name needs it).

    Returns:
        The script's absolute path, or None.

    Raises:
        MainScriptError: naming ``flag`` and the value, when ``path`` is not an existing ``.py`` file.
    """
    if path is None:
        MAIN_SCRIPT.clear()
        _restore_main()
        return None
    given = os.fspath(path)
    found = Path(given).expanduser().resolve()
    expected = "the Python script (a .py file) that defines what the config names as __main__.<name>"
    if found.suffix != ".py":
        raise MainScriptError(f"{flag} {given}: expected {expected}; {found.name!r} does not end in .py")
    if not found.is_file():
        where = f" ({found})" if str(found) != given else ""
        what = "is a folder" if found.is_dir() else "does not exist"
        raise MainScriptError(
            f"{flag} {given}: the file{where} {what}; expected {expected}, relative to {Path.cwd()}"
        )
    if script() != found:
        _restore_main()
    MAIN_SCRIPT[:] = [found]
    if str(found.parent) not in sys.path:  # its own modules import by plain name, after installed ones,
        sys.path.append(str(found.parent))  # in every process multiprocessing starts from here too
        _ADDED_PATH.append(str(found.parent))
    return found


_ADDED_PATH: list[str] = []
"""Folders of scripts appended to ``sys.path`` here, taken off when the script is forgotten."""


def script() -> Path | None:
    """The script named by :func:`use_main`, or None."""
    return MAIN_SCRIPT[0] if MAIN_SCRIPT else None


def _is_script(module: types.ModuleType | None, path: Path) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).resolve() == path


def main_module() -> types.ModuleType:
    """The module ``__main__.<name>`` is looked up in: the script of :func:`use_main`, imported as
    ``__mp_main__`` on first use (once per process); without one, ``__main__`` itself.

    Raises:
        ConfigError: the script raised while it was imported (naming the script and the error).
    """
    path = script()
    if path is None:
        return importlib.import_module("__main__")
    for name in ("__main__", MAIN_NAME):  # already this process's script, or a rank's import of it
        if _is_script(sys.modules.get(name), path):
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location(MAIN_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = sys.modules.get(MAIN_NAME)
    sys.modules[MAIN_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        if before is None:
            sys.modules.pop(MAIN_NAME, None)
        else:
            sys.modules[MAIN_NAME] = before
        if not isinstance(err, Exception):
            raise
        raise ConfigError(f"importing --main {path} raised {type(err).__name__}: {err}") from err
    _stand_in_for_main(module)
    return module


_UNISON_MAIN: list[types.ModuleType] = []
"""The ``__main__`` the script stands in for (unison's own entry), to put back when it is forgotten."""


def _stand_in_for_main(module: types.ModuleType) -> None:
    """Makes the script this process's ``__main__`` as well, where ``__main__`` is unison itself.

    Every process multiprocessing starts from here (spawned ranks, a fork server's ranks, the
    worker pool that preprocesses ``data.files`` with ``data.n_processes``, DataLoader workers
    started with spawn) imports the parent's ``__main__`` script as ``__mp_main__`` before it
    unpickles anything: with the script there, the script's functions sent to it by name are
    found. Like a script Python runs, it has no ``__spec__``, so it is prepared from its file.
    Where ``__main__`` is a script of the user's (the Python API), it is left alone.
    """
    if running_main_problem() is None:
        return
    _UNISON_MAIN.append(sys.modules["__main__"])
    module.__spec__ = None
    sys.modules["__main__"] = module


def _restore_main() -> None:
    if _UNISON_MAIN:
        sys.modules["__main__"] = _UNISON_MAIN[0]
        _UNISON_MAIN.clear()
    for folder in _ADDED_PATH:
        if folder in sys.path:
            sys.path.remove(folder)
    _ADDED_PATH.clear()


def nearest_names(module: types.ModuleType, name: str) -> str:
    """For a message: where a name was looked for, and the public names of ``module`` nearest to it."""
    names = [n for n in vars(module) if not n.startswith("_")]
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    where = f"your script {module.__file__}" if module.__name__ == MAIN_NAME else "__main__"
    return f"{where} has no {name!r}" + (f"; nearest: {', '.join(near)}" if near else "")
