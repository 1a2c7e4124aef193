"""Counting host syncs or collectives inside iterations only, from an engine's handlers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ignite.engine import Engine, Events


class IterationProbe:
    """Enters ``probe()`` at ``ITERATION_STARTED`` and leaves it after the ``ITERATION_COMPLETED``
    handlers attached before this one; everything between two iterations (epoch events, the
    sync points) is left out.

    ``probe`` is a context-manager factory such as ``count_host_syncs`` (whose result has
    ``.calls``) or ``count_collectives`` (a Counter). Attach it after every other handler.
    """

    def __init__(self, probe: Callable[[], Any]) -> None:
        self._probe = probe
        self._stack: contextlib.ExitStack | None = None
        self.records: list[Any] = []
        self.iterations = 0

    def attach(self, engine: Engine) -> IterationProbe:
        engine.add_event_handler(Events.ITERATION_STARTED, self._enter)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._leave)
        # A run that fails mid-iteration must not leave the probe installed.
        engine.add_event_handler(Events.COMPLETED, self._close)
        engine.add_event_handler(Events.TERMINATE, self._close)
        return self

    def _enter(self, _: Engine) -> None:
        self._stack = contextlib.ExitStack()
        self.records.append(self._stack.enter_context(self._probe()))
        self.iterations += 1

    def _leave(self, _: Engine) -> None:
        self._close(_)

    def _close(self, _: Engine | None = None) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    @property
    def calls(self) -> list[str]:
        """Host syncs: every read's name, over all iterations."""
        return [call for record in self.records for call in record.calls]

    @property
    def count(self) -> int:
        return len(self.calls)

    def collectives(self) -> int:
        """Collectives: the total over all names and iterations."""
        return sum(sum(record.values()) for record in self.records)
