"""The config's ``handlers``: the user's own handlers, planned once and attached on every rank.

:func:`handlers_plan` resolves each item of the ``handlers`` list against its slot (a handler
class, or a function of the user's modules), reads its event and checks that its arguments
bind, before any rank starts: every problem is refused at the item's key, with its file and
line. :func:`build_user_handlers` builds them on each rank, in the order written, and attaches
those with ``order: before`` at once; :meth:`UserHandlers.attach_after` attaches the others
once unison's own handlers are attached. A handler object with ``state_dict()`` and
``load_state_dict()`` is saved in every checkpoint and put back on resume, as
``handlers:<ClassName>``; with ``per_rank_state = True`` each rank's own
(:mod:`unison.checkpoint.per_rank`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from unison.config import Config
from unison.config.handlers_config import INJECTED, parse_event
from unison.engine import Engine, Events, UpdateEvents
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.references import _References

PREFIX = "handlers:"
"""The checkpoint names of the user's handlers: ``handlers:<ClassName>`` (``#2`` for a second one)."""

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
        to: ``"trainer"`` or ``"validation"``.
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
    if to == "validation" and name in UpdateEvents.__members__:
        raise refs.error(key, f"{name} is the trainer's (validation's evaluator makes no updates)")
    try:
        _fired(name, filters)
    except ValueError as err:
        raise refs.error(key, f"{name}({filters}): {err}") from None


def _fired(name: str, filters: dict[str, int]) -> Any:
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


@dataclass
class UserHandlers:
    """The user's handlers of one rank: built in the order written, with their engines."""

    built: list[tuple[UserHandler, Any, Engine]] = field(default_factory=list)

    @property
    def to_save(self) -> dict[str, Any]:
        """``handlers:<ClassName>`` -> each handler object with a state, for the checkpoint."""
        named: dict[str, Any] = {}
        for planned, obj, _ in self.built:
            if not planned.is_class or not callable(getattr(obj, "state_dict", None)):
                continue
            name, n = f"{PREFIX}{type(obj).__name__}", 2
            while name in named:
                name, n = f"{PREFIX}{type(obj).__name__}#{n}", n + 1
            named[name] = obj
        return named

    def attach(self, order: str) -> None:
        """Attaches the handlers of ``order`` (``"before"`` or ``"after"`` unison's own), in the order written."""
        for planned, obj, engine in self.built:
            if planned.order != order:
                continue
            if planned.event is None:
                obj.attach(engine)
            elif planned.is_class:
                engine.add_event_handler(_fired(*planned.event), obj)
            else:
                engine.add_event_handler(_fired(*planned.event), obj, *planned.args, **planned.kwargs)

    def attach_after(self) -> None:
        """Attaches the handlers with ``order: after``: call once unison's own handlers are attached."""
        self.attach("after")


def build_user_handlers(handlers: tuple[UserHandler, ...], parts: RunParts) -> UserHandlers:
    """Builds the user's handler objects in the order written and attaches those with ``order: before``.

    Distributed:
        Every rank builds and attaches every handler (a handler filters by rank inside its side effects).
    """
    made = UserHandlers()
    supply = {
        "trainer": parts.trainer,
        "evaluator": parts.evaluator,
        "model": parts.model,
        "optimizer": parts.optimizer,
    }
    for planned in handlers:
        engine = parts.evaluator if planned.to == "validation" else parts.trainer
        obj = planned.target
        if planned.is_class:
            given = {name: supply[name] for name in planned.injected}
            obj = planned.target(*planned.args, **given, **planned.kwargs)
        made.built.append((planned, obj, engine))
    made.attach("before")
    return made
