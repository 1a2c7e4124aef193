"""Where a config's keys were written: the one locator of config errors.

An :class:`Origin` holds the config's file, the line of every key in it, and the keys the
command line's ``--set`` gave, with the text that gave them. Every config error about a
key is made by :meth:`Origin.error`, which names ``<file>:<line>: <key>: ...`` or
``--set key=value: <key>: ...``; a :class:`~unison.config.loader.RawConfig` carries one
while it is checked, and the :class:`~unison.config.schema.Config` it becomes carries one
while it is resolved and run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from unison.config.errors import ConfigError

KeyPath = tuple[str, ...]


def key_paths(value: Any, prefix: KeyPath = ()) -> Iterator[KeyPath]:
    """Every key path inside ``value``: mapping keys, and list items by index (as lines count them)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        path = prefix + (str(key),)
        yield path
        yield from key_paths(child, path)


@dataclass(frozen=True)
class Origin:
    """A config's file, the line of each key path, and its ``--set`` overrides.

    Attributes:
        file: the config file (None for a config built in Python: errors name ``<config>``).
        lines: the line (1-based) of each key path written in the file.
        overrides: the key paths set from the command line, with the ``--set`` text that set them.
        written: every key path the config holds as written (file and ``--set``), defaults not counted.
    """

    file: str | None = None
    lines: Mapping[KeyPath, int] = field(default_factory=dict)
    overrides: Mapping[KeyPath, str] = field(default_factory=dict)
    written: frozenset[KeyPath] = frozenset()

    def with_set(self, path: KeyPath, value: Any, text: str) -> Origin:
        """This origin after ``--set text`` gave ``path`` the value ``value`` (a section's keys replaced)."""
        kept = {p for p in self.written if p[: len(path)] != path}
        added = {path[:i] for i in range(1, len(path) + 1)} | {path + p for p in key_paths(value)}
        return replace(self, overrides={**self.overrides, path: text}, written=frozenset(kept | added))

    def set_by(self, path: KeyPath) -> KeyPath | None:
        """The ``--set`` key that gave ``path`` its value: ``path`` or a section above it, else one below
        it (which gave it its shape); None when the file did."""
        for i in range(len(path), 0, -1):
            if path[:i] in self.overrides:
                return path[:i]
        for key in self.overrides:
            if key[: len(path)] == path:
                return key
        return None

    def from_command_line(self, path: KeyPath) -> bool:
        """Whether a ``--set`` of ``path`` or of a section above it gave ``path`` its value."""
        return any(path[:i] in self.overrides for i in range(len(path), 0, -1))

    def line_of(self, path: KeyPath) -> int | None:
        """The line of ``path``, or of its nearest ancestor in the file; None when a ``--set`` gave it."""
        if self.set_by(path) is not None:
            return None
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def file_of(self, path: KeyPath) -> str | None:
        """The file, or the ``--set`` option, that gave ``path`` its value."""
        key = self.set_by(path)
        return f"--set {self.overrides[key]}" if key is not None else self.file

    def error(self, path: KeyPath, message: str) -> ConfigError:
        """The :class:`ConfigError` about the key ``path``: ``<file>:<line>: <key>: message``, or
        ``--set key=value: <key>: message`` when the command line gave the key."""
        return ConfigError(message, file=self.file_of(path), line=self.line_of(path), key=path)

    def given(self, *path: str) -> bool:
        """Whether the key ``path`` is written in the config or set by ``--set`` (not a default)."""
        return tuple(path) in self.written


NO_ORIGIN = Origin()
"""The origin of a config built in Python: no file, no lines."""
