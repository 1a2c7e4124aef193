"""One walk over the schema's keys, for everything generated from it.

The configuration reference (:mod:`unison.config.reference`), the JSON Schema
(:mod:`unison.config.json_schema`) and ``unison config --show-origin`` read the schema's
dataclasses through :func:`section_keys` and :func:`walk_keys`, so a key added to
:mod:`unison.config.schema` reaches all of them at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from unison.config.origin import KeyPath
from unison.config.schema import Config, _hints, _is_section, item_section, section_in

ITEM = "<i>"
"""The path element standing for any item of a list of sections (``handlers.<i>.type``)."""


@dataclass(frozen=True)
class SchemaKey:
    """One key of the schema.

    Attributes:
        path: the key path (``("training", "max_epochs")``).
        type: the key's annotation, resolved (``int``, ``Literal["max", "min"]``, a section class).
        default: its default value (a fresh copy for a list or a mapping; a section's default instance).
        doc: its line of documentation.
        alias: an old name still read for it, or None.
        slot: the ``!pyobject`` slot it fills, or None.
        any_case: whether its ``Literal`` values are read in any case.
    """

    path: KeyPath
    type: Any
    default: Any
    doc: str
    alias: str | None
    slot: str | None
    any_case: bool = False

    @property
    def is_section(self) -> bool:
        """Whether the key is a whole section (its value is always a mapping)."""
        return _is_section(self.type)

    @property
    def section(self) -> type | None:
        """The section class the key takes as a mapping (itself a section, or one in a union); None for a
        plain key."""
        return section_in(self.type)


def section_keys(cls: type, prefix: KeyPath = ()) -> list[SchemaKey]:
    """The keys of the section ``cls`` (:class:`~unison.config.schema.Config` for the top level), in the
    order the schema declares them, with their paths under ``prefix``."""
    hints = _hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        factory: Any = f.default_factory
        default = factory() if factory is not dataclasses.MISSING else f.default
        keys.append(
            SchemaKey(
                path=prefix + (f.name,),
                type=hints[f.name],
                default=default,
                doc=f.metadata.get("doc", ""),
                alias=f.metadata.get("alias"),
                slot=f.metadata.get("slot"),
                any_case=f.metadata.get("any_case", False),
            )
        )
    return keys


def walk_keys(cls: type = Config, prefix: KeyPath = ()) -> Iterator[SchemaKey]:
    """Every key under ``cls``, depth first: each key, then the keys of the section it takes (a whole
    section, or a key that also takes a mapping, such as ``training.ema``)."""
    for key in section_keys(cls, prefix):
        yield key
        sub = key.section
        if sub is not None:
            yield from walk_keys(sub, key.path)
        items = item_section(key.type)  # a list of sections (handlers): the keys of each item
        if items is not None:
            yield from walk_keys(items, key.path + (ITEM,))
