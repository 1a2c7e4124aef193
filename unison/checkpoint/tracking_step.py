"""The step a tracker logs a training run's points at: the trainer's iteration, kept going
across a resume at another world size.

A resume at another world size, or with data of another length, renumbers the trainer's
iterations (``epochs done x the new epoch length``,
:func:`~unison.checkpoint.state.refit_epoch_length`): iteration 14 of 7-batch epochs becomes
iteration 8 of 4-batch ones. A tracker whose step were the iteration would go back to step 8
and drop, or overwrite, what it logged at steps 9-14. :func:`renumber` sets the new iteration
and adds the difference to ``engine.state.step_offset``, so :func:`tracking_step`, the
iteration plus that offset, continues where the run left off and never goes back. The offset
is saved with the trainer's state (its ``"unison"`` entry, :mod:`unison.engine.saved`), so it
holds over any number of resumes. A run never renumbered has offset 0: its steps are its
iterations.
"""

from __future__ import annotations

from typing import Any

STEP_OFFSET_ATTR = "step_offset"
"""The ``engine.state`` attribute: what a renumbering took off the iteration."""


def step_offset(engine: Any) -> int:
    """``engine.state.step_offset``; 0 for an engine never renumbered (any ignite Engine)."""
    return int(getattr(engine.state, STEP_OFFSET_ATTR, 0) or 0)


def tracking_step(engine: Any) -> int:
    """The trainer's step for trackers: its iteration plus :func:`step_offset`.

    Example:
        >>> from ignite.engine import Engine
        >>> engine = Engine(lambda e, b: None)
        >>> engine.state.iteration = 14
        >>> renumber(engine, 8)  # resumed at twice the world size: epochs of 4, not 7, batches
        >>> engine.state.iteration, tracking_step(engine)
        (8, 14)
    """
    return int(engine.state.iteration) + step_offset(engine)


def renumber(engine: Any, iteration: int) -> None:
    """Sets ``engine.state.iteration`` to ``iteration`` keeping :func:`tracking_step` as it is."""
    offset = tracking_step(engine) - int(iteration)
    engine.state.iteration = int(iteration)
    setattr(engine.state, STEP_OFFSET_ATTR, offset)
