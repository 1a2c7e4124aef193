"""The end of an engine's run, said once to everything that closes something at it.

A handler that holds something for the length of a run (a thread, a file, a tracker's run, a
signal handler, a folder's lock) registers ``callback(how)`` with
:meth:`Engine.add_close_callback <unison.engine.Engine.add_close_callback>` (or :func:`on_close`,
which takes a plain ignite Engine too), and is called once per run with how the run ended:

- ``"finished"``: after the last ``COMPLETED`` handler; a run stopped by ``terminate()`` (early
  stopping, a time limit) fires ``COMPLETED`` after ``TERMINATE`` and so finishes too;
- ``"terminated"``: after the last ``TERMINATE`` handler of a run stopped without ``COMPLETED``
  (``terminate(skip_completed=True)``);
- ``"failed"``: when an exception ends the run, before it propagates; it is never swallowed.

Callbacks are called in the order they were added, every one even when another raises. Closing
a finished or terminated run raises the first error after the last callback (noted with the
callback and where); closing a failed run logs a callback's error as a warning, so the run's own
error is the one that propagates. Like composer's ``Callback.close``: one path, however the run
ends, instead of ``COMPLETED`` + ``TERMINATE`` + a failure hook written in every handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events

from unison.engine.checks import handler_name
from unison.utils.exception_notes import add_note
from unison.utils.logging import get_logger

_log = get_logger(__name__)

How = Literal["finished", "terminated", "failed"]
"""How a run ended, as close callbacks are told."""

CloseCallback = Callable[[How], None]


class RunClose:
    """An engine's close callbacks, and whether its run is open (from ``STARTED`` to its end).

    Args:
        name: the engine's name, for warnings.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._callbacks: list[tuple[Callable[..., None], bool]] = []  # (callback, on failure only)
        self.open = False

    def add(self, callback: CloseCallback) -> None:
        """Calls ``callback(how)`` once at the end of every run; adding it twice has no effect."""
        if (callback, False) not in self._callbacks:
            self._callbacks.append((callback, False))

    def add_on_failure(self, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` when a run fails only; adding it twice has no effect."""
        if (callback, True) not in self._callbacks:
            self._callbacks.append((callback, True))

    def names(self) -> list[str]:
        """The callbacks' names, in order (for the check that every rank added the same)."""
        return [handler_name(callback) for callback, _ in self._callbacks]

    def start(self) -> None:
        """At ``STARTED``: the run is open, and its end will be said."""
        self.open = True

    def at_end(self, event: Any, should_terminate: Any, where: str) -> None:
        """After the handlers of ``COMPLETED`` (finished) or ``TERMINATE`` (terminated, when no
        ``COMPLETED`` follows: ``should_terminate`` is ``"skip_completed"``)."""
        if event is Events.COMPLETED:
            self.close("finished", where)
        elif should_terminate == "skip_completed":
            self.close("terminated", where)

    def close(self, how: How, where: str) -> None:
        """Calls every callback (``where``: the engine's place, for notes), once per run."""
        if not self.open:
            return
        self.open = False
        first: BaseException | None = None
        for callback, failure_only in list(self._callbacks):
            if failure_only and how != "failed":
                continue
            try:
                callback() if failure_only else callback(how)
            except BaseException as err:
                if how == "failed" and isinstance(err, Exception):  # never hide the run's own error
                    _log.warning(
                        "%s: %s raised while closing the failed run: %s: %s",
                        self.name, handler_name(callback), type(err).__name__, err,
                    )  # fmt: skip
                elif first is None:
                    add_note(err, f"raised by {handler_name(callback)} closing the run ({how}) at {where}")
                    first = err
        if first is not None:
            raise first


def on_close(engine: IgniteEngine, callback: CloseCallback) -> None:
    """Registers ``callback(how)`` for the end of ``engine``'s runs: through
    :meth:`~unison.engine.Engine.add_close_callback` on a unison Engine. On a plain ignite Engine,
    ``"finished"`` at ``COMPLETED`` and ``"terminated"`` at ``TERMINATE`` without ``COMPLETED``;
    a failure is not seen there (ignite has no hook that cannot swallow the error)."""
    add = getattr(engine, "add_close_callback", None)
    if callable(add):
        add(callback)
        return

    def _completed(_: Any) -> None:
        callback("finished")

    def _terminated(e: Any) -> None:
        if getattr(e, "should_terminate", None) == "skip_completed":  # no COMPLETED follows
            callback("terminated")

    engine.add_event_handler(Events.COMPLETED, _completed)
    engine.add_event_handler(Events.TERMINATE, _terminated)
