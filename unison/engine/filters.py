"""Handlers on filtered events (``every``, ``once``, ``before``, ``after``) that cost one call
on the iterations where they do not fire.

ignite wraps such a handler in a function that looks the event's counter up by event name
(hashing the event enum twice, in Python) and calls the filter: 22 to 28 Python calls on
every iteration, for a handler that may fire once in a thousand. For ignite's own filters the
wrapper here compares the counter inline, so a handler that does not fire costs the call to
its wrapper and nothing else (a counter other than ``iteration`` or ``epoch`` adds one
``getattr``). A filter of the user's own (``event_filter=``) keeps ignite's wrapper.

The filters are recognised by their code objects, which ignite's filter factories share
between all the closures they make; their parameters are read from the closures' cells.
``tests/engine/test_call_budget.py`` fires both wrappers on the same counters.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ignite.engine import State
from ignite.engine.events import CallableEventWithFilter

from unison.engine.ignite_internals import check_ignite_internals

if TYPE_CHECKING:
    from ignite.engine import Engine

_EVERY = CallableEventWithFilter.every_event_filter(2).__code__
_ONCE = CallableEventWithFilter.once_event_filter([1]).__code__
_RANGE = CallableEventWithFilter.before_and_after_event_filter(1, 0).__code__
_EVERY_IN_RANGE = CallableEventWithFilter.every_before_and_after_event_filter(2, 1, 0).__code__


def _cells(event_filter: Callable[..., bool]) -> dict[str, Any]:
    names = event_filter.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, event_filter.__closure__ or (), strict=True)}


def _predicate(event_filter: Callable[..., bool]) -> tuple[str, tuple[Any, ...]] | None:
    """``(kind, parameters)`` of one of ignite's filters; None for any other callable."""
    code = getattr(event_filter, "__code__", None)
    if code is None:
        return None
    try:
        cells = _cells(event_filter)
        if code is _EVERY:
            return "every", (int(cells["every"]),)
        if code is _ONCE:
            return "once", (frozenset(int(v) for v in cells["once"]),)
        if code is _RANGE:
            return "range", (cells["after_"], cells["before_"])
        if code is _EVERY_IN_RANGE:
            return "every_in_range", (int(cells["every"]), cells["after_"], cells["before_"])
    except (KeyError, TypeError, ValueError):  # an ignite whose closures hold other names
        return None
    return None


def filtered_handler(
    engine: Engine, handler: Callable[..., Any], event_name: Any, event_filter: Callable[..., bool]
) -> Callable[..., Any] | None:
    """The handler wrapped to fire only when ``event_filter`` passes, or None when the filter is
    not one of ignite's (the caller then uses ignite's wrapper).

    Raises:
        IgniteInternalsChanged: the installed ignite no longer recognises a filtered handler by
            its wrapper's ``_parent`` (checked once per process).
    """
    check_ignite_internals()
    found = _predicate(event_filter)
    attr = State.event_to_attr.get(event_name)
    if found is None or attr is None:
        return None
    kind, params = found
    by_name = attr not in ("iteration", "epoch")
    on_epoch = attr == "epoch"

    # One wrapper per kind, each a single comparison: the counter is read inline.
    if kind == "every":
        (every,) = params

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = engine.state
            value = getattr(state, attr) if by_name else state.epoch if on_epoch else state.iteration
            if value % every == 0:
                return handler(*args, **kwargs)
            return None

    elif kind == "once":
        (once,) = params

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = engine.state
            value = getattr(state, attr) if by_name else state.epoch if on_epoch else state.iteration
            if value in once:
                return handler(*args, **kwargs)
            return None

    elif kind == "range":
        after, before = params

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = engine.state
            value = getattr(state, attr) if by_name else state.epoch if on_epoch else state.iteration
            if after < value < before:
                return handler(*args, **kwargs)
            return None

    else:
        every, after, before = params

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = engine.state
            value = getattr(state, attr) if by_name else state.epoch if on_epoch else state.iteration
            if after < value < before and (value - after - 1) % every == 0:
                return handler(*args, **kwargs)
            return None

    wrapped = functools.wraps(handler)(wrapper)  # the signature check inspects the handler's
    wrapped._parent = weakref.ref(handler)  # type: ignore[attr-defined]  # ignite's has_event_handler reads it
    return wrapped
