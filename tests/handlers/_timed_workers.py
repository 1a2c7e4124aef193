"""Rank functions of the timed-save tests: a Checkpoint(every_seconds=...) on a fake clock.

Each rank's clock is a number that a handler advances by that rank's ``tick`` after every
iteration, starting at that rank's ``origin``: no test sleeps, and ranks' clocks can be
made to disagree as much as a test likes. The same functions run in-process at world size 1.
"""

from __future__ import annotations

from typing import Any

from _ckpt_workers import build_run
from _collective_probe import count_collectives

from unison.distributed import get_rank
from unison.engine import Events


def timed_saves(
    folder: str,
    *,
    every_seconds: float,
    ticks: list[float],
    origins: list[float] | None = None,
    max_epochs: int = 2,
    checkpoint: dict[str, Any] | None = None,
    save_takes: float = 0.0,
    **parts: Any,
) -> dict[str, Any]:
    """Trains with ``Checkpoint(every_seconds=...)`` (epoch saves off unless ``checkpoint`` says
    otherwise) and returns the iterations at which this rank began a save, the iterations at
    which the ranks agreed a timed save was due, and the files rank 0 wrote. Each save's write
    moves the clock on by ``save_takes``, inside ``save()`` (a save that takes time)."""
    rank = get_rank()
    options = {"every_epochs": None, **(checkpoint or {}), "every_seconds": every_seconds}
    run = build_run(folder, checkpoint=options, **parts)
    timed = run.checkpoint.timed
    now = [origins[rank] if origins else 0.0]
    timed.clock = lambda: now[0]

    @run.trainer.on(Events.ITERATION_COMPLETED)
    def _tick(engine: Any) -> None:
        now[0] += ticks[rank]

    began: list[int] = []
    restart = timed.restart

    def _restart() -> None:  # called as the run starts and as every save begins
        began.append(run.trainer.state.iteration)
        restart()

    timed.restart = _restart
    if save_takes:
        write = run.checkpoint.writer.write

        def _slow_write(*args: Any, **kwargs: Any) -> Any:  # inside save(): its clock moves on
            now[0] += save_takes
            return write(*args, **kwargs)

        run.checkpoint.writer.write = _slow_write
    run.trainer.run(run.loader, max_epochs=max_epochs)
    return {
        "saves": began[1:],  # the first is the run's start
        "asked": list(timed.asked),
        "files": [p.name for p in run.checkpoint.saved],
        "epoch_length": run.trainer.state.epoch_length,
    }


def collectives_of_a_run(folder: str, every_seconds: float | None, **parts: Any) -> dict[str, int]:
    """The collectives one epoch issues with no save at all, with or without ``every_seconds``
    (a clock that never reaches it): what the timed saves add to every iteration."""
    options = {"every_epochs": None, "at_end": False}
    if every_seconds is not None:
        options["every_seconds"] = every_seconds
    run = build_run(folder, checkpoint=options, **parts)
    with count_collectives() as calls:
        run.trainer.run(run.loader, max_epochs=1)
    counted = {name: n for name, n in calls.items() if n}
    counted["iterations"] = run.trainer.state.iteration
    return counted


def disagreeing_clocks(
    folder: str, *, every_seconds: float, ticks: list[float], origins: list[float], **parts: Any
):
    """:func:`timed_saves`, then the collectives of an epoch without and with ``every_seconds``."""
    saved = timed_saves(folder + "/timed", every_seconds=every_seconds, ticks=ticks, origins=origins, **parts)
    saved["without"] = collectives_of_a_run(folder + "/without", None, **parts)
    saved["with"] = collectives_of_a_run(folder + "/with", 1e9, **parts)
    return saved
