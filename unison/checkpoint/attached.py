"""The state of the handlers attached to a trainer, saved with its checkpoints unasked.

Users of other frameworks expect a handler's state (early stopping's counter and best
score, a custom handler's running value) to come back on resume without listing it. A
checkpoint therefore also saves every object attached to the trainer (an event handler's
owner, or a contributor to its sync point) that has ``state_dict()`` and
``load_state_dict()``, under a stable name: ``handler:<ClassName>`` (``#2``, ``#3``... for
further ones of a class, in attach order). What ``to_save`` lists wins: an object listed
there is saved under its name only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from unison.checkpoint.verify import NotPlainError, to_plain
from unison.utils.logging import get_logger

_log = get_logger(__name__)

PREFIX = "handler:"


def _owners(engine: Any) -> Iterable[Any]:
    """Objects attached to ``engine``: the owners of its event handlers, then its sync contributors."""
    for handlers in getattr(engine, "_event_handlers", {}).values():
        for func, _, _ in handlers:
            parent = getattr(func, "_parent", None)  # ignite wraps filtered handlers
            handler = parent() if callable(parent) else func
            yield getattr(handler, "__self__", handler)
    sync_point = getattr(engine, "sync_point", None)
    if sync_point is not None:
        yield from sync_point.contributors()


def _stateful(obj: Any) -> bool:
    from ignite.metrics import Metric  # metrics reset every epoch: their state is not a handler's

    return (
        callable(getattr(type(obj), "state_dict", None))
        and callable(getattr(type(obj), "load_state_dict", None))
        and not isinstance(obj, Metric)
        and type(obj).__module__ != "unison.engine.control"  # the engine's own stop requests
    )


def _savable(obj: Any) -> bool:
    """Whether ``obj``'s state loads with ``weights_only=True``; if not it is left out, with a
    warning naming the fix (a handler the user lists in ``to_save`` is refused instead)."""
    try:
        to_plain(obj.state_dict(), f"{PREFIX}{type(obj).__name__}")
    except NotPlainError as err:
        _log.warning("Not saving the state of the attached %s: %s", type(obj).__name__, err)
        return False
    return True


def attached_states(engine: Any, exclude: Iterable[Any]) -> dict[str, Any]:
    """name -> object, for the stateful objects attached to ``engine`` and not in ``exclude``."""
    skip = {id(obj) for obj in exclude} | {id(engine)}
    found: dict[str, Any] = {}
    for obj in _owners(engine):
        if id(obj) in skip or not _stateful(obj) or not _savable(obj):
            skip.add(id(obj))
            continue
        skip.add(id(obj))
        name, n = f"{PREFIX}{type(obj).__name__}", 2
        while name in found:
            name, n = f"{PREFIX}{type(obj).__name__}#{n}", n + 1
        found[name] = obj
    return found


def load_attached(objects: Mapping[str, Any], states: Mapping[str, Any]) -> None:
    """Loads the saved states of attached handlers by name; names on one side only are logged."""
    for name, obj in objects.items():
        if name in states:
            obj.load_state_dict(states[name])
        else:
            _log.warning(
                "Resuming: the checkpoint holds no state for %s (attached after it was saved?).", name
            )
    extra = sorted(n for n in states if n.startswith(PREFIX) and n not in objects)
    if extra:
        _log.warning("Resuming: the checkpoint holds state for %s, which this run does not attach.", extra)
