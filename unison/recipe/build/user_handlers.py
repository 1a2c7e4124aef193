"""The config's ``handlers``: the user's own handlers, planned once and attached on every rank.

:func:`~unison.recipe.planning.handlers_plan.handlers_plan` resolves each item of the ``handlers`` list against its slot (a handler
class, or a function of the user's modules), reads its event and checks that its arguments
bind, before any rank starts: every problem is refused at the item's key, with its file and
line. :func:`build_user_handlers` builds them on each rank, in the order written, and attaches
those with ``order: before`` at once; :meth:`UserHandlers.attach_after` attaches the others
once unison's own handlers are attached, and :meth:`UserHandlers.attach_to_tester` those with
``to: testing`` to the test phase's evaluator when the test phase builds it. A handler object with ``state_dict()`` and
``load_state_dict()`` is saved in every checkpoint and put back on resume, as
``handlers:<ClassName>``; with ``per_rank_state = True`` each rank's own
(:mod:`unison.checkpoint.per_rank`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unison.engine import Engine
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.handlers_plan import UserHandler, fired

PREFIX = "handlers:"
"""The checkpoint names of the user's handlers: ``handlers:<ClassName>`` (``#2`` for a second one)."""


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
        """Attaches the handlers of ``order`` (``"before"`` or ``"after"`` unison's own), in the order
        written; those of the test phase wait for its evaluator (:meth:`attach_to_tester`)."""
        for planned, obj, engine in self.built:
            if planned.order != order or planned.to == "testing":
                continue
            self._attach(planned, obj, engine)

    def attach_to_tester(self, tester: Engine) -> None:
        """Attaches the handlers with ``to: testing`` to the test phase's evaluator, in the order written."""
        for planned, obj, _ in self.built:
            if planned.to == "testing":
                self._attach(planned, obj, tester)

    @staticmethod
    def _attach(planned: UserHandler, obj: Any, engine: Engine) -> None:
        if planned.event is None:
            obj.attach(engine)
        elif planned.is_class:
            engine.add_event_handler(fired(*planned.event), obj)
        else:
            engine.add_event_handler(fired(*planned.event), obj, *planned.args, **planned.kwargs)

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
        engine = parts.evaluator if planned.to == "validation" else parts.trainer  # testing's: later
        obj = planned.target
        if planned.is_class:
            given = {name: supply[name] for name in planned.injected}
            obj = planned.target(*planned.args, **given, **planned.kwargs)
        made.built.append((planned, obj, engine))
    made.attach("before")
    return made
