"""Stops every rank together once a wall-clock budget is spent."""

from __future__ import annotations

import time

from ignite.engine import Engine, Events

from unison.handlers.synced import SyncedHandler


class TimeLimit(SyncedHandler):
    """Stops training on all ranks at the first sync point after ``seconds`` have passed.

    Ranks' clocks and start times differ, so each rank only reports whether its own
    budget is spent; the report rides in the engine's sync point, and all ranks stop at
    the same iteration as soon as one of them is over. The overshoot is at most the time
    between two sync points (``sync_every`` iterations).

    Args:
        seconds: the budget, counted from the run's start on each rank.

    Example:
        .. code-block:: python

            TimeLimit(seconds=3600).attach(trainer)

    Distributed:
        Attach it on every rank of a unison Engine.
    """

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"TimeLimit(seconds={seconds!r}) must be a positive number.")
        super().__init__()
        self.seconds = float(seconds)
        self._start: float | None = None

    def _started(self, _: Engine) -> None:
        self._start = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self._start is None else time.monotonic() - self._start

    def attach_events(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._started)

    def local_values(self) -> tuple[float]:
        return (self.elapsed(),)

    def on_agreed(self, values: list[list[float]]) -> str | None:
        (elapsed,) = values
        if not any(e >= self.seconds for e in elapsed):
            return None
        spent = ", ".join(f"rank {r} {e:.1f} s" for r, e in enumerate(elapsed))
        return f"time limit of {self.seconds:g} s reached (elapsed: {spent})"
