"""The user's own modules: files beside a config, and the modules its ``imports:`` names.

Files beside a config are imported by file path, under a private package name
(``unison.config.usercode.f<hex of the folder>.<name>``), never by putting the folder on
``sys.path``: a ``tqdm.py`` or ``torch.py`` beside a config cannot replace the installed
package for anyone else, and the user's module still imports. The private name is the
same in every process (it encodes the folder), so every rank that re-resolves a config
gets the same module name, and an object pickled by reference imports back in a worker.

``imports:`` may name the user's own code only: a module beside the config, or a module
installed or on ``sys.path`` that is neither in the standard library, nor torch, ignite or
unison, nor a library unison itself depends on, nor a data loader (numpy, joblib ...).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import sysconfig
import types
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

__path__: list[str] = []  # a package: each config folder is a subpackage, found by _Finder

PREFIX = __name__
"""The private package that modules beside a config are imported under."""

RESERVED = ("torch", "ignite", "unison")
"""Always the installed packages: a file beside the config of the same name is never used
for them, and ``imports:`` cannot name them (typed slots already take their classes)."""

LOADERS = (
    "numpy", "joblib", "dill", "cloudpickle", "pandas", "h5py", "scipy", "sklearn", "yaml", "pip",
    "setuptools", "pkg_resources", "IPython", "pytest", "_pytest", "matplotlib", "fsspec", "sympy",
    "jinja2", "networkx", "filelock", "tensorboardX", "tensorboard", "tqdm", "safetensors", "requests",
    "urllib3", "packaging", "typing_extensions",
)  # fmt: skip
"""Libraries ``imports:`` never names, besides the standard library and unison's own
dependencies: they load files (``numpy.load``, ``joblib.load``), run code or render templates."""

_DOTTED = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def folder_package(folder: Path) -> str:
    """The private package name of the modules in ``folder`` (the same in every process)."""
    return f"{PREFIX}.f{str(folder.resolve()).encode('utf-8').hex()}"


_FOLDERS: list[Path] = []
"""Config folders whose modules were resolved in this process: their modules may import one
another by plain name (``import helpers``), found after everything installed."""


def local_module(top: str, folder: Path | None) -> str | None:
    """The private name of module ``top`` when it is a file (or package) in ``folder``, else None."""
    if folder is None or top in RESERVED or not _DOTTED.match(top) or "." in top:
        return None
    if (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file():
        if folder.resolve() not in _FOLDERS:
            _FOLDERS.append(folder.resolve())
        return f"{folder_package(folder)}.{top}"
    return None


class _AliasLoader(importlib.abc.Loader):
    """Makes a plain name (``helpers``) the very module imported under its private name."""

    def __init__(self, private: str) -> None:
        self.private = private

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return importlib.import_module(self.private)

    def exec_module(self, module: types.ModuleType) -> None:
        return None  # already executed under its private name: one module, one set of classes


class _SiblingFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: a top-level name nothing installed provides, found as a module
    beside a resolved config. Installed packages always win, so nothing is shadowed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or "." in fullname:
            return None
        for folder in _FOLDERS:
            private = local_module(fullname, folder)
            if private is not None:
                return importlib.machinery.ModuleSpec(fullname, _AliasLoader(private))
        return None


class _FolderLoader(importlib.abc.Loader):
    """Creates the package of one config folder: empty, with the folder as its ``__path__``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``unison.config.usercode.f<hex>``: the package whose ``__path__`` is that folder.

    Its modules are then found by the ordinary path finder in that folder only.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, tail = fullname.rpartition(".")
        if head != PREFIX or not tail.startswith("f"):
            return None
        try:
            folder = bytes.fromhex(tail[1:]).decode("utf-8")
        except ValueError:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _FolderLoader(), is_package=True)
        spec.submodule_search_locations = [folder]
        return spec


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.append(_Finder())
if not any(isinstance(finder, _SiblingFinder) for finder in sys.meta_path):
    sys.meta_path.append(_SiblingFinder())


@functools.lru_cache(maxsize=1)
def dependency_modules() -> frozenset[str]:
    """Top-level modules of the distributions unison depends on (its required ones, recursively)."""
    seen: set[str] = set()
    todo = ["unison"]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if match:
                todo.append(match.group(1))
    modules: set[str] = set()
    for module, dists in metadata.packages_distributions().items():
        if any(re.sub(r"[-_.]+", "-", d).lower() in seen for d in dists):
            modules.add(module)
    return frozenset(modules - {"unison"})


def in_stdlib(top: str) -> bool:
    """Whether the top-level module ``top`` is part of Python's standard library."""
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or origin in ("built-in", "frozen"):
        return spec is not None and origin in ("built-in", "frozen")
    paths = sysconfig.get_paths()
    location = Path(origin).resolve()
    for name in ("stdlib", "platstdlib"):
        root = Path(paths[name]).resolve()
        if root in location.parents and "site-packages" not in location.parts:
            return True
    return False


def refused_import(entry: str, folder: Path | None) -> str | None:
    """Why ``imports:`` may not name ``entry``, or None when it names the user's own code."""
    if not _DOTTED.match(entry):
        return f"{entry!r} is not a dotted module name like my_package.models"
    if any(part.startswith("_") for part in entry.split(".")):
        return f"{entry!r}: private modules (a part starting with '_') cannot be named"
    top = entry.split(".")[0]
    if top in RESERVED:
        return (
            f"{top} is not your own code: the typed slots take its classes without `imports:`, "
            "and naming it here would let its functions into slots that take your functions"
        )
    if local_module(top, folder) is not None:
        return None
    if in_stdlib(top):
        return f"{top} is in Python's standard library, which a config cannot reach"
    if top in LOADERS or top in dependency_modules():
        return (
            f"{top} is a library, not your own code (it loads files or runs code); "
            "`imports:` names modules of your project"
        )
    return None


def refused_library(top: str, folder: Path | None) -> str | None:
    """Why the installed library ``top`` may not give model parts (layer classes, an ``nn``
    package's functions), or None when it may: installed, and neither the standard library,
    nor a data loader, nor a library unison itself depends on, nor a module beside the config."""
    if not _DOTTED.match(top) or top.startswith("_") or top in RESERVED or local_module(top, folder):
        return f"{top!r} is not an installed library"
    if in_stdlib(top) or top in LOADERS or top in dependency_modules():
        return f"{top} loads files or runs code (it is the standard library or a loader), not model parts"
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"no installed library {top!r}"


def describe(obj: object) -> str:
    """What ``obj`` is, for messages: ``function torch.utils.collect_env.run``, ``class torch.nn.Linear``."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    module = getattr(obj, "__module__", None)
    where = f"{public_module(module)}.{name}" if isinstance(module, str) and name else str(name)
    if isinstance(obj, types.ModuleType):
        return f"module {public_module(obj.__name__)}"
    if isinstance(obj, type):
        return f"class {where}"
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        return f"function {where}"
    if isinstance(obj, types.BuiltinFunctionType):
        return f"built-in function {where}"
    text = repr(obj)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"a {type(obj).__qualname__} ({text})"


def public_module(name: str | None) -> str:
    """``name`` as the user wrote it: the private folder package is dropped."""
    if not name:
        return "?"
    if name in MAIN_MODULES:  # the user's script, as the config names it
        return "__main__"
    if name.startswith(PREFIX + ".f"):
        parts = name.split(".")
        return ".".join(parts[len(PREFIX.split(".")) + 1 :]) or name
    return name


MAIN_MODULES = ("__main__", "__mp_main__")
"""The script that started Python, as a spawned rank names it too (``__mp_main__``)."""

MAIN_FIX = (
    "Name the script that defines {name} on the command line: `unison run CONFIG --main your_script.py` "
    '(it is imported as `__mp_main__`, so its `if __name__ == "__main__":` block does not run); or put '
    "{name} in a module of your own and name it there: `!pyobject mymodule.{name}` with "
    "`imports: [mymodule]` (or mymodule.py beside the config); or run the config from your own script "
    "with `unison.recipe.run(path, nproc=...)`, where `__main__` is that script"
)
"""What to do instead of naming ``__main__`` where it is not the user's script."""

MAIN_SCRIPT: list[Path] = []
"""The script ``--main`` names (:mod:`unison.config.main_script`), when one does: ``__main__``
stands for it."""


def main_problem() -> str | None:
    """Why ``!pyobject __main__.x`` cannot name the user's code in this process, or None when it can.

    ``__main__`` is the user's own script when that script runs the config through unison's
    Python API (``unison.recipe.run(path)``); its spawned ranks import it again as
    ``__mp_main__``; and when ``--main SCRIPT.py`` names it. Otherwise, under ``unison run``
    (``python -m unison``, the ``unison`` console script, torchrun or srun running either)
    ``__main__`` is unison itself.
    """
    if MAIN_SCRIPT:  # `--main SCRIPT.py`: the user's script, whatever started Python
        return None
    return running_main_problem()


def running_main_problem() -> str | None:
    """Why ``__main__``, the module this process started with, is not the user's script, or None."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    entry = getattr(getattr(main, "main", None), "__module__", None)
    package = Path(__file__).resolve().parents[1]
    if (
        str(getattr(spec, "name", "") or "").split(".")[0] == "unison"
        or entry == "unison.cli"
        or (file is not None and package in Path(file).resolve().parents)
    ):
        return "under `unison run`, `__main__` is the unison command itself, not your code"
    if not file:
        return (
            "`__main__` is not a script file here (an interactive session or `python -c`), so the ranks "
            "could not import it"
        )
    return None
