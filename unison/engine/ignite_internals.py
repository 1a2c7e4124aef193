"""Whether the installed ignite still has the private Engine internals unison's Engine relies on.

unison's :class:`~unison.engine.Engine` is a thin subclass of ignite's, and where ignite
has no public hook it uses ignite 0.5's private ones (pinned ``<0.6``):

- ``Engine._handler_wrapper(handler, event_name, event_filter)`` is what
  ``add_event_handler`` calls for a filtered event (``Events.X(every=2)``); unison's
  override builds the cheaper filter wrappers of :mod:`unison.engine.filters`;
- a wrapper's ``_parent`` (a weak reference to the user's handler) is how
  ``has_event_handler`` and ``remove_event_handler`` recognise a filtered handler, and how
  checkpoints find the handlers attached to a trainer (:mod:`unison.checkpoint.attached`):
  without it a handler guarded by ``has_event_handler`` is attached twice, and a filtered
  handler's state is left out of checkpoints;
- ``Engine._event_handlers`` maps each event to one list of ``(handler, args, kwargs)``,
  appended to in place (the engine keeps the lists of its per-iteration events);
- ``_fire_event``, ``_setup_dataloader_iter``, ``_is_done`` and ``_handle_exception``,
  which the engine's loop calls or overrides.

:func:`check_ignite_internals` tells once per process, when the first engine is built, and
refuses to run on an ignite that changed any of them.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import ignite
from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events

_METHODS = ("_fire_event", "_setup_dataloader_iter", "_is_done", "_handle_exception", "_handler_wrapper")


class IgniteInternalsChanged(RuntimeError):
    """The installed ignite lacks, or changed, a private Engine internal unison relies on."""


@functools.cache
def ignite_internals_problem() -> str | None:
    """What ignite's Engine does differently from what unison's Engine relies on, or None."""
    missing = [name for name in _METHODS if not callable(getattr(IgniteEngine, name, None))]
    if missing:
        return f"ignite's Engine has no {', '.join(missing)}"
    made: list[Callable[..., Any]] = []

    class Probe(IgniteEngine):
        def _handler_wrapper(self, handler: Callable, event_name: Any, event_filter: Callable) -> Callable:
            def wrapper(engine: IgniteEngine) -> None:
                handler(engine)

            wrapper._parent = weakref.ref(handler)  # type: ignore[attr-defined]
            made.append(wrapper)
            return wrapper

    def handler(engine: IgniteEngine) -> None:
        pass

    engine = Probe(lambda engine, batch: None)
    event = Events.EPOCH_COMPLETED
    handlers = engine._event_handlers[event]  # a defaultdict(list) in ignite 0.5
    engine.add_event_handler(event(every=2), handler)
    if len(made) != 1:
        return "add_event_handler no longer calls Engine._handler_wrapper for a filtered event"
    if engine._event_handlers.get(event) is not handlers or [h for h, *_ in handlers] != made:
        return "Engine._event_handlers no longer holds, per event, one list of (handler, args, kwargs) appended to"
    if not engine.has_event_handler(handler, event):
        return "has_event_handler no longer recognises a filtered handler by its wrapper's _parent"
    engine.remove_event_handler(handler, event)
    if engine._event_handlers.get(event):
        return "remove_event_handler no longer removes a filtered handler named by its wrapper's _parent"
    return None


def check_ignite_internals() -> None:
    """Raises :class:`IgniteInternalsChanged` when the installed ignite changed a private
    Engine internal unison relies on (see :func:`ignite_internals_problem`); checked once
    per process."""
    problem = ignite_internals_problem()
    if problem is not None:
        raise IgniteInternalsChanged(
            f"pytorch-ignite {ignite.__version__}: {problem}. unison's Engine relies on private internals "
            'of ignite 0.5: pip install "pytorch-ignite>=0.5.5,<0.6" (see `unison doctor`).'
        )
