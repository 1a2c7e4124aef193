"""Pruning a trial of a hyperparameter sweep: asked once, on rank 0, and agreed by every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ignite.engine import Engine, Events

from unison.distributed.primitives import get_rank
from unison.distributed.sync import require_sync_point
from unison.handlers.synced import SyncedHandler
from unison.utils.logging import get_logger

_log = get_logger(__name__)

Judge = Callable[[float, int], "str | None"]
"""``judge(value, step) -> reason to prune, or None``: asked on rank 0 only."""


class AgreedPruning(SyncedHandler):
    """Stops every rank together when a judge, asked once after each evaluation, says to prune.

    After each evaluation rank 0 (and only rank 0) reads the metric and asks
    ``judge(value, epoch)``: for ``unison tune`` the judge reports the value to the Optuna
    trial and asks its pruner. The verdict travels in the trainer's next sync point as
    rank 0's vote; every rank reads the same vote and, when it says prune, every rank stops
    after the same iteration (at the end of the epoch the evaluation closed). No other rank
    asks, and no rank acts on a verdict of its own: a pruner that reads shared storage, or
    a clock, cannot send the ranks different ways.

    Args:
        trainer: the engine to stop (a unison Engine).
        metric: the name of a value in the evaluator's ``state.metrics``.
        judge: ``fn(value, step) -> reason or None``, called on rank 0 only; ``step`` is
            the trainer's epoch.

    Attributes:
        pruned: whether the ranks agreed to prune (the same on every rank).
        reason: the judge's reason, on rank 0.

    Example:
        >>> from unison.engine import Engine
        >>> trainer = Engine(lambda e, b: None)
        >>> evaluator = Engine(lambda e, b: None)
        >>> @evaluator.on(Events.COMPLETED)
        ... def score(engine):
        ...     engine.state.metrics["loss"] = 1.0 / trainer.state.epoch
        >>> _ = trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([0]))
        >>> pruning = AgreedPruning(trainer, "loss", lambda value, step: "too slow" if step == 2 else None)
        >>> pruning.attach(evaluator)
        >>> trainer.run(range(3), max_epochs=5).epoch, pruning.pruned
        (2, True)

    Distributed:
        Build and attach it on every rank: its vote travels in the trainer's collective.
    """

    def __init__(self, trainer: Engine, metric: str, judge: Judge) -> None:
        require_sync_point(trainer, "AgreedPruning(trainer=...)")
        if not callable(judge):
            raise TypeError(
                f"AgreedPruning(judge=...) must be fn(value, step) -> reason or None, got {judge!r}."
            )
        super().__init__()
        self.trainer = trainer
        self.metric = metric
        self.judge = judge
        self.pruned = False
        self.reason: str | None = None
        self._vote = False

    def __call__(self, evaluator: Engine) -> None:
        if get_rank() != 0:
            return  # the judge is asked once per evaluation, by rank 0: the others learn its verdict
        try:
            value = float(evaluator.state.metrics[self.metric])
        except KeyError:
            raise KeyError(
                f"AgreedPruning(metric={self.metric!r}): no such value in the evaluator's metrics "
                f"({sorted(evaluator.state.metrics)}). Name a validation metric."
            ) from None
        self.reason = self.judge(value, int(self.trainer.state.epoch))
        self._vote = self.reason is not None

    def local_values(self) -> tuple[float]:
        return (1.0 if self._vote else 0.0,)

    def on_agreed(self, values: list[list[float]]) -> str | None:
        (votes,) = values
        self._vote = False
        if votes[0] <= 0 or self.pruned:
            return None  # only rank 0's vote counts; the other ranks never asked
        self.pruned = True
        epoch = self.trainer.state.epoch
        return f"pruned after epoch {epoch}: {self.reason}" if self.reason else f"pruned after epoch {epoch}"

    def sync_engine(self, engine: Engine) -> Engine:
        return self.trainer

    def attach(self, engine: Engine, event: Any = None) -> None:
        """Asks after each run of ``engine`` (the evaluator: at ``COMPLETED``; the trainer itself:
        at ``EPOCH_COMPLETED``); the vote travels in the trainer's sync point."""
        if event is None:
            event = Events.EPOCH_COMPLETED if engine is self.trainer else Events.COMPLETED
        if not engine.has_event_handler(self, event):
            engine.add_event_handler(event, self)
        super().attach(engine)
