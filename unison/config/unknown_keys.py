"""Every unknown key of a config at once, each with its file, line and the nearest valid key.

:func:`check_unknown_keys` walks the raw config against the schema before any value is
checked, so a config with three misspelt keys is refused once, naming all three, instead
of three times in a row.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from unison.config.loader import KeyPath, RawConfig
from unison.config.schema import _hints, _is_section, item_section, section_in


def _unknown(cls: type, data: Any, path: KeyPath, out: list[tuple[KeyPath, str]]) -> None:
    if not isinstance(data, dict):
        return  # not a mapping: the type check names it
    fields = {f.name for f in dataclasses.fields(cls)}
    if getattr(cls, "EXTRA_KEYS", None) is not None:
        return  # a section that keeps the keys it does not define
    aliases = {f.metadata["alias"]: f.name for f in dataclasses.fields(cls) if f.metadata.get("alias")}
    hints = _hints(cls)
    for key, value in data.items():
        key = str(key)
        name = aliases.get(key, key)
        if name not in fields:
            near = difflib.get_close_matches(key, sorted(fields) + list(aliases), n=1, cutoff=0.6)
            where = ".".join(path) or "the top level"
            hint = f" Did you mean {near[0]!r}?" if near else ""
            out.append(
                (
                    path + (key,),
                    f"unknown key {key!r} in {where}. Valid keys: {', '.join(sorted(fields))}.{hint}",
                )
            )
            continue
        sub = section_in(hints[name])
        if sub is not None and (_is_section(hints[name]) or isinstance(value, dict)):
            _unknown(sub, value, path + (key,), out)
        items = item_section(hints[name])  # a list of sections: each item's keys
        if items is not None and isinstance(value, list):
            for i, item in enumerate(value):
                _unknown(items, item, path + (key, str(i)), out)


def check_unknown_keys(cls: type, raw: RawConfig) -> None:
    """Refuses the config if any key is unknown to the schema ``cls``, naming every one.

    Raises:
        ConfigError: at the first unknown key (its file and line); with more than one, the
            message lists each with its own ``file:line: key``, in the order written.
    """
    found: list[tuple[KeyPath, str]] = []
    _unknown(cls, raw.data, (), found)
    if not found:
        return
    first_path, first_message = found[0]
    if len(found) == 1:
        raise raw.origin.error(first_path, first_message)
    lines = []
    for path, message in found:
        line = raw.origin.line_of(path)
        where = f"{raw.origin.file_of(path) or '<config>'}{f':{line}' if line is not None else ''}"
        lines.append(f"  {where}: {'.'.join(path)}: {message}")
    raise raw.origin.error(first_path, f"{len(found)} unknown keys:\n" + "\n".join(lines))
