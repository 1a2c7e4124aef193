"""Reading YAML configs safely, with a ``!pyobject`` tag and the line of every key."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from unison.config.errors import ConfigError
from unison.config.origin import KeyPath, Origin, key_paths


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


MAX_BYTES = 1 << 20
"""The largest config file read, in bytes (a config is a few kilobytes)."""
MAX_DEPTH = 64
"""The deepest nesting of mappings and lists a config may have."""
MAX_NODES = 100_000
"""The most values a config may hold once its aliases are expanded (an alias bomb holds billions)."""


def check_budget(text: str, name: str) -> None:
    """Refuses a document past the size, depth or alias-expansion budget, before it is built.

    The document's events are read one at a time and counted: every alias counts the
    values of the node it repeats, so a billion laughs is refused after reading a few
    lines, an alias inside the node it names (a recursive document) at once, and a deep
    nesting at level :data:`MAX_DEPTH`.

    Raises:
        ConfigError: naming the file and the line where the budget ran out.
        yaml.YAMLError: for a syntax error met on the way.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise ConfigError(
            f"the config is {size} bytes; configs are limited to {MAX_BYTES} bytes. "
            "Keep data in files that data.build reads, not in the config",
            file=name,
        )
    sizes: dict[str, int] = {}
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, values so far) per open collection
    total = 0

    def fail(message: str, event: yaml.Event) -> ConfigError:
        mark = event.start_mark
        return ConfigError(message, file=name, line=mark.line + 1 if mark else None)

    def add(count: int, event: yaml.Event) -> None:
        nonlocal total
        total += count
        if total > MAX_NODES:
            raise fail(
                f"the config expands to more than {MAX_NODES} values (through its aliases): "
                "refused as an alias bomb; write the values out or use fewer aliases",
                event,
            )
        if open_nodes:
            anchor, count_so_far = open_nodes[-1]
            open_nodes[-1] = (anchor, count_so_far + count)

    for event in yaml.parse(text, Loader=UnisonLoader):  # noqa: S506 - a SafeLoader subclass, events only
        if isinstance(event, yaml.AliasEvent):
            anchor = event.anchor
            if any(open_anchor == anchor for open_anchor, _ in open_nodes):
                raise fail(
                    f"the alias *{anchor} is inside the node &{anchor} it repeats: a recursive document",
                    event,
                )
            add(sizes.get(anchor or "", 1), event)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            add(1, event)
        elif isinstance(event, yaml.CollectionStartEvent):
            if len(open_nodes) >= MAX_DEPTH:
                raise fail(f"the config nests deeper than {MAX_DEPTH} levels", event)
            open_nodes.append((event.anchor, 1))
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, count = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = count
            add(count, event)


def _line_map(node: yaml.Node, prefix: KeyPath, out: dict[KeyPath, int], file: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                _line_map(value_node, prefix, {}, file)
                continue
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode) and key in seen:
                raise ConfigError(
                    f"{key!r} is set twice, on lines {seen[key]} and {line}; keep one of them "
                    "(YAML would silently keep the last)",
                    file=file,
                    line=line,
                    key=prefix + (key,),
                )
            seen[key] = line
            out[prefix + (key,)] = line
            _line_map(value_node, prefix + (key,), out, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[prefix + (str(i),)] = item.start_mark.line + 1
            _line_map(item, prefix + (str(i),), out, file)


def read_value(text: str, name: str) -> Any:
    """Reads a YAML value (a ``--set`` value) with the budget and duplicate checks of a config file."""
    check_budget(text, name)
    node = yaml.compose(text, Loader=UnisonLoader)  # noqa: S506 - a SafeLoader subclass
    if node is not None:
        _line_map(node, (), {}, name)
    return yaml.load(text, Loader=UnisonLoader)  # noqa: S506


@dataclass
class RawConfig:
    """A config as read: plain data (with :class:`PyObjectRef` leaves) and where each key is."""

    data: dict[str, Any]
    origin: Origin
    """The file, the line of each key, and the keys the command line's ``--set`` gave."""

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
        self.origin = self.origin.with_set(path, value, origin)


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
        if path.stat().st_size > MAX_BYTES:
            raise ConfigError(
                f"the config is {path.stat().st_size} bytes; configs are limited to {MAX_BYTES} bytes",
                file=name,
            )
        text = path.read_text()

    class _Loader(UnisonLoader):
        file_name = name

    lines: dict[KeyPath, int] = {}

    def key_at(line: int | None) -> KeyPath:
        """The outermost key on ``line``: the one whose value holds the tag."""
        on_line = [path for path, where in lines.items() if where == line]
        return min(on_line, key=len) if on_line else ()

    try:
        check_budget(text, name)
        node = yaml.compose(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        if node is not None:
            _line_map(node, (), lines, name)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506
    except ConfigError as err:
        key = err.key_path.split(".") if err.key_path else key_at(err.line)
        raise ConfigError(err.problem, file=name, line=err.line, key=key) from None
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
    return RawConfig(data, Origin(name, lines, {}, frozenset(key_paths(data))))
