"""``handlers``: the user's own handlers, a list of typed slots attached in the order written.

A section of the schema (:mod:`unison.config.schema`), one item per handler::

    handlers:
      - type: !pyobject my_recipe.HiddenState        # a class: built, then attach(engine)
        kwargs: {size: 4}
      - function: !pyobject my_recipe.log_norm       # a function: fn(engine, *args, **kwargs)
        event: ITERATION_COMPLETED(every=10)
        to: validation                               # the evaluator instead of the trainer

The checks here are the section's shape (one of ``type`` or ``function``, an event for a
function, an event written as ``NAME`` or ``NAME(every=N)``); what the names resolve to,
whether the event exists and whether the arguments bind are the plan's
(:mod:`unison.recipe.build.user_handlers`), before any rank starts. What each key does is
docs/handlers.md's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from unison.config.loader import KeyPath, PyObjectRef, RawConfig

EVENT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$")
"""``NAME`` or ``NAME(key=value, ...)``."""

FILTERS = ("every", "once", "before", "after")
"""The keyword arguments an event takes (ignite's event filters), each a positive int."""

INJECTED = ("trainer", "evaluator", "model", "optimizer")
"""Parameters of a handler class that get unison's objects when ``args`` and ``kwargs`` leave them out."""


def _key(default: Any, doc: str, slot: str | None = None) -> Any:
    metadata = {"doc": doc, "alias": None, "slot": slot}
    if isinstance(default, (dict, list)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class HandlerConfig:
    type: PyObjectRef | None = _key(
        None,
        "a handler class of your own modules: built as type(*args, **kwargs) (parameters named trainer, "
        "evaluator, model or optimizer get unison's), then attach(engine), or called at `event`",
        slot="handler",
    )
    function: PyObjectRef | None = _key(
        None,
        "instead of type: a function of your own modules, called as fn(engine, *args, **kwargs) at `event`",
        slot="handler_function",
    )
    event: str | None = _key(
        None,
        "when a function (or an instance of type) is called: an event of the engine, e.g. EPOCH_STARTED, "
        "ITERATION_COMPLETED(every=10), UPDATE_COMPLETED; with every, once, before or after",
    )
    args: list[Any] = _key([], "positional arguments (after the engine, for a function)")
    kwargs: dict[str, Any] = _key({}, "keyword arguments")
    to: Literal["trainer", "validation", "testing"] = _key(
        "trainer",
        "the engine: the trainer, validation's evaluator, or the test phase's evaluator (built after "
        "training; its handlers attach to it then, in the order written)",
    )
    order: Literal["after", "before"] = _key(
        "after",
        "attached after unison's own handlers (validation, scheduler, early stopping, checkpoint, logging), "
        "or before them; either way in the order written, and saved before a checkpoint is taken",
    )


def parse_event(text: str) -> tuple[str, dict[str, int]] | str:
    """``("ITERATION_COMPLETED", {"every": 10})`` from ``"ITERATION_COMPLETED(every=10)"``; or what is wrong.

    Example:
        >>> parse_event("ITERATION_COMPLETED(every=10)")
        ('ITERATION_COMPLETED', {'every': 10})
        >>> parse_event("EPOCH_STARTED(often=2)")
        "takes every, once, before or after, got 'often'"
    """
    match = EVENT.match(text)
    if match is None:
        return "expected NAME or NAME(every=N), e.g. ITERATION_COMPLETED(every=10)"
    name, inside = match.group(1), (match.group(2) or "").strip()
    filters: dict[str, int] = {}
    for part in [p.strip() for p in inside.split(",")] if inside else []:
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in FILTERS:
            return f"takes {', '.join(FILTERS[:-1])} or {FILTERS[-1]}, got {key!r}"
        if not value.isdigit() or int(value) < 1:
            return f"{key} must be a positive whole number, got {value!r}"
        filters[key] = int(value)
    return name.upper(), filters


def check_handlers(handlers: list[HandlerConfig], raw: RawConfig) -> None:
    """Each item names one handler: ``type`` or ``function`` (not both), an event for a function, and an
    event that reads as one.

    Raises:
        ConfigError: at the item's key, with its file and line.
    """
    for i, item in enumerate(handlers):
        at: KeyPath = ("handlers", str(i))
        if (item.type is None) == (item.function is None):
            both = item.type is not None
            raise raw.origin.error(
                at + (("function",) if both else ()),
                "give one of type (a handler class) and function (a function called at an event), "
                + ("not both" if both else "got neither"),
            )
        if item.function is not None and item.event is None:
            raise raw.origin.error(
                at + ("function",), "a function needs `event:` (when to call it), e.g. EPOCH_COMPLETED"
            )
        if item.event is not None:
            parsed = parse_event(item.event)
            if isinstance(parsed, str):
                raise raw.origin.error(at + ("event",), f"{item.event!r}: {parsed}")
