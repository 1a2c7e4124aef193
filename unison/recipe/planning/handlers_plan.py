"""The config's ``handlers``, planned once: each item resolved against its slot (a handler class,
or a function of the user's modules), its event read and its arguments bound, before any rank
starts; every problem is refused at the item's key, with its file and line. Each rank builds and
attaches them from this plan (:mod:`unison.recipe.build.user_handlers`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from unison.config import Config
from unison.config.handlers_config import INJECTED, parse_event
from unison.engine import Events, UpdateEvents
from unison.recipe.planning.references import _References

_REFUSED_EVENTS = {
    "EXCEPTION_RAISED": "its handlers get the exception as well; a failure already ends every rank with its "
    "traceback",
}


@dataclass(frozen=True)
class UserHandler:
    """One item of ``handlers``, resolved and checked.

    Attributes:
        key: its key path (``handlers.0``), for messages.
        target: the handler class, or the function.
        is_class: whether ``target`` is a class (built, then attached) or a function.
        args: the positional arguments.
        kwargs: the keyword arguments, references resolved.
        injected: the parameters of the class that get unison's objects (trainer, evaluator, model, optimizer).
        event: the event name and its filter (``("ITERATION_COMPLETED", {"every": 10})``); None: attach(engine).
        to: ``"trainer"``, ``"validation"`` or ``"testing"`` (the test phase's evaluator).
        order: ``"before"`` or ``"after"`` unison's own handlers.
    """

    key: str
    target: Any
    is_class: bool
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    injected: tuple[str, ...]
    event: tuple[str, dict[str, int]] | None
    to: str
    order: str


def _event(name: str, filters: dict[str, int], to: str, refs: _References, key: str) -> None:
    """Refuses an event the engine does not fire, or a filter ignite refuses."""
    if name in _REFUSED_EVENTS:
        raise refs.error(key, f"{name} cannot take a handler from a config: {_REFUSED_EVENTS[name]}")
    members = [*Events.__members__, *UpdateEvents.__members__]
    if name not in members:
        raise refs.error(key, f"{name!r} is no event of the engine; events: {', '.join(members)}")
    if to != "trainer" and name in UpdateEvents.__members__:
        raise refs.error(key, f"{name} is the trainer's ({to}'s evaluator makes no updates)")
    try:
        fired(name, filters)
    except ValueError as err:
        raise refs.error(key, f"{name}({filters}): {err}") from None


def fired(name: str, filters: dict[str, int]) -> Any:
    event: Any = Events[name] if name in Events.__members__ else UpdateEvents[name]
    return event(**filters) if filters else event


def _injected(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The parameters of ``cls`` named like unison's objects that ``args`` and ``kwargs`` leave unset."""
    try:
        signature = inspect.signature(cls)
        taken = set(signature.bind_partial(*args).arguments)
    except (TypeError, ValueError):
        return ()
    return tuple(n for n in INJECTED if n in signature.parameters and n not in taken and n not in kwargs)


def handlers_plan(config: Config, refs: _References) -> tuple[UserHandler, ...]:
    """Every item of ``handlers``, resolved against its slot, its event read, its arguments bound.

    Raises:
        ConfigError: at the item's key (file and line): a class that is no handler, a function that is
            not the user's, an unknown event, arguments that do not bind.
    """
    planned = []
    for i, item in enumerate(config.handlers):
        at = f"handlers.{i}"
        is_class = item.type is not None
        key = f"{at}.type" if is_class else f"{at}.function"
        target = refs.ref(
            item.type if is_class else item.function, "handler" if is_class else "handler_function", key
        )
        args = tuple(refs.tree({"args": item.args}, at)["args"])
        kwargs = refs.tree(item.kwargs, f"{at}.kwargs")
        event = None
        if item.event is not None:
            parsed = parse_event(item.event)
            assert not isinstance(parsed, str)  # checked when the config was validated
            _event(*parsed, item.to, refs, f"{at}.event")
            event = parsed
        injected = _injected(target, args, kwargs) if is_class else ()
        if is_class and event is None and not callable(getattr(target, "attach", None)):
            raise refs.error(
                key,
                f"{target.__qualname__} has no attach(engine): define it, or give `event:` to call its "
                "instances as handler(engine) at that event",
            )
        refs.bind(
            target,
            type_key=key,
            kwargs_key=f"{at}.kwargs",
            kwargs=kwargs,
            args=args if is_class else (None, *args),
            supplied={name: None for name in injected},
            how=" (unison passes the engine first)" if not is_class else "",
        )
        planned.append(UserHandler(at, target, is_class, args, kwargs, injected, event, item.to, item.order))
    return tuple(planned)
