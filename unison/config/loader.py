"""Reading YAML configs safely, with a ``!pyobject`` tag and the line of every key."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from unison.config.errors import ConfigError

KeyPath = tuple[str, ...]


@dataclass(frozen=True)
class PyObjectRef:
    """An inert reference to a Python object, written ``!pyobject dotted.path`` in YAML.

    Loading a config never imports or calls anything: the tag gives this reference, and
    :func:`unison.config.resolve` imports it later, when the run is built, through an
    allow-list, and checks its type against the slot it fills.
    """

    path: str
    file: str = field(default="<string>", compare=False)
    line: int = field(default=0, compare=False)

    def __str__(self) -> str:
        return f"!pyobject {self.path}"


class UnisonLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader plus ``!pyobject``, registered on this class only.

    Tags added to ``yaml.SafeLoader`` itself would change every ``yaml.safe_load`` in the
    process; this subclass keeps them to unison's configs. Python tags
    (``!!python/object``, ``!!python/name`` ...) stay refused, as in SafeLoader.
    """

    file_name = "<string>"


def _construct_pyobject(loader: UnisonLoader, node: yaml.Node) -> PyObjectRef:
    if not isinstance(node, yaml.ScalarNode):
        raise ConfigError(
            "!pyobject takes a dotted path, like `!pyobject torch.optim.AdamW`, not a list or a mapping",
            file=loader.file_name,
            line=node.start_mark.line + 1,
        )
    path = str(loader.construct_scalar(node)).strip()
    return PyObjectRef(path, loader.file_name, node.start_mark.line + 1)


UnisonLoader.add_constructor("!pyobject", _construct_pyobject)


def _yaml_1_2_scalars(loader: type[yaml.SafeLoader]) -> None:
    """Reads scalars as YAML 1.2 (and people) do, on ``loader`` only.

    PyYAML follows YAML 1.1: ``3e-4`` (no dot) is a string, and ``yes``, ``no``, ``on``,
    ``off`` are booleans, so ``lr: 3e-4`` would reach the optimizer as text and
    ``name: no`` would be False.
    """
    bool_tag = "tag:yaml.org,2002:bool"
    loader.add_implicit_resolver(  # copies the resolver table onto this class first
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    for first, resolvers in loader.yaml_implicit_resolvers.items():
        loader.yaml_implicit_resolvers[first] = [(tag, rx) for tag, rx in resolvers if tag != bool_tag]
    loader.add_implicit_resolver(
        bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )


_yaml_1_2_scalars(UnisonLoader)


def _line_map(node: yaml.Node, prefix: KeyPath, out: dict[KeyPath, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = str(key_node.value)
            out[prefix + (key,)] = key_node.start_mark.line + 1
            _line_map(value_node, prefix + (key,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[prefix + (str(i),)] = item.start_mark.line + 1
            _line_map(item, prefix + (str(i),), out)


@dataclass
class RawConfig:
    """A config as read: plain data (with :class:`PyObjectRef` leaves) and where each key is."""

    data: dict[str, Any]
    file: str
    lines: dict[KeyPath, int]
    overrides: dict[KeyPath, str] = field(default_factory=dict)
    """Key paths set from the command line, with the ``--set`` text that set them."""

    def _overridden(self, path: KeyPath) -> KeyPath | None:
        for i in range(len(path), 0, -1):
            if path[:i] in self.overrides:
                return path[:i]
        for key in self.overrides:  # a --set below this key gave it its (bad) shape
            if key[: len(path)] == path:
                return key
        return None

    def line_of(self, path: KeyPath) -> int | None:
        """The line of ``path``, or of its nearest ancestor that is in the file."""
        if self._overridden(path) is not None:
            return None
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def file_of(self, path: KeyPath) -> str:
        """The file, or the ``--set`` option, that gave ``path`` its value."""
        key = self._overridden(path)
        return f"--set {self.overrides[key]}" if key is not None else self.file

    def set(self, path: KeyPath, value: Any, origin: str) -> None:
        """Sets ``path`` (creating sections) as the command line's ``--set`` does."""
        node = self.data
        for i, key in enumerate(path[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"cannot set {'.'.join(path)}: {'.'.join(path[: i + 1])} is a {type(child).__name__}, not a section",
                    file=f"--set {origin}",
                )
            node = child
        node[path[-1]] = value
        self.overrides[path] = origin


def load_yaml(source: str | os.PathLike[str], *, text: str | None = None) -> RawConfig:
    """Reads a YAML config file (or ``text``, named ``source``) with :class:`UnisonLoader`.

    Raises:
        ConfigError: with the file and line, for a YAML syntax error, a refused tag, or a
            document that is not a mapping.
    """
    name = str(source)
    if text is None:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found (working directory: {os.getcwd()})", file=name)
        text = path.read_text()

    class _Loader(UnisonLoader):
        file_name = name

    lines: dict[KeyPath, int] = {}

    def key_at(line: int | None) -> KeyPath:
        """The outermost key on ``line``: the one whose value holds the tag."""
        on_line = [path for path, where in lines.items() if where == line]
        return min(on_line, key=len) if on_line else ()

    try:
        node = yaml.compose(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        if node is not None:
            _line_map(node, (), lines)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506
    except ConfigError as err:
        raise ConfigError(err.problem, file=name, line=err.line, key=key_at(err.line)) from None
    except yaml.constructor.ConstructorError as err:
        mark = err.problem_mark
        tag = err.problem or "an unknown tag"
        line = mark.line + 1 if mark else None
        raise ConfigError(
            f"{tag}: Python tags are refused, configs are data. Name classes and functions with "
            "`!pyobject dotted.path` instead",
            file=name,
            line=line,
            key=key_at(line),
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(
            f"YAML syntax error: {problem}", file=name, line=mark.line + 1 if mark else None
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"a config is a mapping of sections, got a {type(data).__name__}", file=name, line=1
        )
    return RawConfig(data=data, file=name, lines=lines)
