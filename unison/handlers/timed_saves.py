"""Saves at an agreed iteration once a wall-clock interval has passed since the last save."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from ignite.engine import Engine, Events

from unison.distributed.primitives import get_rank
from unison.handlers.synced import SyncedHandler
from unison.utils.logging import get_logger

_log = get_logger(__name__)


class Saver(Protocol):
    """What :class:`TimedSaves` needs of a checkpoint handler: a way to ask for a save."""

    def request_save(self) -> None: ...


def check_seconds(seconds: object) -> float:
    """``seconds`` as a float if it is a positive, finite number; else a ValueError naming it."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError(
            f"Checkpoint(every_seconds={seconds!r}) must be a positive, finite number of seconds "
            "(e.g. 1800), or None for no timed saves."
        )
    return float(seconds)


class TimedSaves(SyncedHandler):
    """Asks a checkpoint handler for a save at the first sync point ``seconds`` after the last.

    The interval is counted on **rank 0's clock**, from the start of the run or of the last
    save, whatever started it (an ``every_iters`` or ``every_epochs`` save, a preemption, a
    timed one): :meth:`restart` is called by every save, on every rank, as it begins, so an
    asynchronous write counts from when it was started, not from when it ended. Each rank
    adds its seconds since its last save to the trainer's sync point, which runs anyway
    (every ``sync_every`` iterations and at epoch ends); the sums come back alike on every
    rank and all read rank 0's number, so all ranks ask for the save after the same
    iteration, however far their own clocks disagree. No collective of its own: the number
    rides in the sync point's one all-reduce.

    Rank 0's clock rather than each rank's or the slowest: rank 0 writes the file and
    stamps its ``saved_at``, so the interval between two saves in the record is the one
    asked for; the other ranks' numbers only appear in the log line of a save.

    The save itself is the checkpoint's (:meth:`Saver.request_save`): mid-epoch it waits
    for the end of the accumulation window, as an ``every_iters`` save does; at an epoch's
    end it is written after the epoch's handlers. The time between sync points bounds how
    late a save can be: ``sync_every`` iterations (with ``sync_every=None``, an epoch).

    Args:
        saver: the checkpoint handler to ask (a :class:`~unison.handlers.Checkpoint`).
        seconds: the interval, a positive number.
        clock: seconds from an arbitrary origin (default ``time.monotonic``).

    Distributed:
        Built and attached by ``Checkpoint(every_seconds=...)`` on every rank.
    """

    def __init__(self, saver: Saver, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.seconds = check_seconds(seconds)
        self.saver = saver
        self.clock = clock
        """The clock read at each sync point and at each save (replaceable, for a test)."""
        self.asked: list[int] = []
        """The iterations after which ranks agreed that a save was due."""
        self._since: float | None = None

    def restart(self) -> None:
        """Counts the interval from now: at the run's start and as any save begins."""
        self._since = self.clock()

    def elapsed(self) -> float:
        """This rank's seconds since the run started or the last save began."""
        return 0.0 if self._since is None else self.clock() - self._since

    def attach_events(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, lambda _: self.restart())

    def local_values(self) -> tuple[float]:
        return (self.elapsed(),)

    def on_agreed(self, values: list[list[float]]) -> None:
        (elapsed,) = values
        iteration = -1 if self.engine is None else self.engine.state.iteration  # type: ignore[attr-defined]
        if elapsed[0] < self.seconds or iteration < 0 or iteration in self.asked[-1:]:
            return None  # the second sync point of an epoch's end asks nothing more: the save follows both
        self.asked.append(iteration)
        if get_rank() == 0:
            clocks = ", ".join(f"rank {r} {e:.1f} s" for r, e in enumerate(elapsed))
            _log.info("Checkpoint: %g s since the last save (%s): saving.", self.seconds, clocks)
        self.saver.request_save()
        return None
