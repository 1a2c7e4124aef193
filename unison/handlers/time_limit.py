"""Stops every rank together once a wall-clock budget is spent."""

from __future__ import annotations

import time

import torch
from ignite.engine import Engine, Events

from unison.engine.sync import require_sync_point
from unison.handlers._rank_slots import rank_row, split_rows


class TimeLimit:
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
        self.seconds = float(seconds)
        self._start: float | None = None
        self.engine: Engine | None = None

    def _started(self, _: Engine) -> None:
        self._start = time.monotonic()

    def elapsed(self) -> float:
        return 0.0 if self._start is None else time.monotonic() - self._start

    def sync_state(self) -> torch.Tensor:
        return rank_row(self.elapsed())

    def load_synced_state(self, state: torch.Tensor) -> None:
        (elapsed,) = split_rows(state, 1)
        over = [r for r, e in enumerate(elapsed) if e >= self.seconds]
        if over and self.engine is not None:
            self.engine.stop_agreed(  # type: ignore[attr-defined]
                f"time limit of {self.seconds:g} s reached (elapsed: "
                + ", ".join(f"rank {r} {e:.1f} s" for r, e in enumerate(elapsed))
                + ")"
            )

    def attach(self, engine: Engine) -> None:
        """Registers on ``engine`` (a unison Engine); attaching twice has no effect."""
        sync_point = require_sync_point(engine, "TimeLimit")
        if engine.has_event_handler(self._started, Events.STARTED):
            return
        self.engine = engine
        engine.add_event_handler(Events.STARTED, self._started)
        sync_point.register(self, scope="every")
