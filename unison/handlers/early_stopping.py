"""Early stopping that stops every rank together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ignite.engine import Engine, Events

from unison.distributed.sync import require_sync_point
from unison.handlers.early_stop_checker import EarlyStopChecker, Mode, ThresholdMode
from unison.handlers.synced import SyncedHandler

Agreement = Literal["rank_zero", "any", "all"]


class EarlyStopping(SyncedHandler):
    """Stops training when a score has not improved for ``patience`` evaluations.

    Attach it to the evaluator (or to the trainer): after each evaluation it reads the
    score and updates an :class:`~unison.handlers.EarlyStopChecker`. Its verdict travels in
    the trainer's next sync point, and the ranks agree: with ``agreement="rank_zero"`` (the
    default) rank 0's verdict holds for all; ``"any"`` stops when one rank's does, ``"all"``
    when every rank's does. Scores computed by unison's metrics are the same on every
    rank; the agreement matters when a score is rank-local. A stop decided after an
    evaluation at an epoch's end takes effect at the end of that same epoch.

    Unlike ignite's ``EarlyStopping.attach(evaluator)``, the counter is never reset by
    the evaluator's own epochs: it counts evaluations.

    Args:
        trainer: the engine to stop (a unison Engine).
        metric: the name of a value in ``engine.state.metrics``, or a function
            ``fn(engine) -> float``.
        patience: evaluations without improvement before stopping.
        mode: ``"max"`` (accuracy) or ``"min"`` (loss).
        min_delta: the smallest change that counts as an improvement.
        threshold_mode: ``"abs"`` or ``"rel"`` (``min_delta`` as a fraction of the best).
        cumulative_delta: see :class:`~unison.handlers.EarlyStopChecker`.
        agreement: ``"rank_zero"``, ``"any"`` or ``"all"``.

    Example:
        .. code-block:: python

            stopper = EarlyStopping(trainer, metric="accuracy", mode="max", patience=3)
            stopper.attach(evaluator)

    Distributed:
        Build and attach it on every rank.
    """

    def __init__(
        self,
        trainer: Engine,
        metric: str | Callable[[Engine], float],
        *,
        patience: int,
        mode: Mode = "min",
        min_delta: float = 0.0,
        threshold_mode: ThresholdMode = "abs",
        cumulative_delta: bool = False,
        agreement: Agreement = "rank_zero",
    ) -> None:
        require_sync_point(trainer, "EarlyStopping(trainer=...)")
        if not (isinstance(metric, str) or callable(metric)):
            raise TypeError(
                f"EarlyStopping(metric=...) must be a metric name or fn(engine) -> float, got {metric!r}."
            )
        if agreement not in ("rank_zero", "any", "all"):
            raise ValueError(f"EarlyStopping(agreement={agreement!r}) must be 'rank_zero', 'any' or 'all'.")
        super().__init__()
        self.trainer = trainer
        self.metric = metric
        self.agreement = agreement
        self.checker = EarlyStopChecker(
            patience,
            mode=mode,
            min_delta=min_delta,
            threshold_mode=threshold_mode,
            cumulative_delta=cumulative_delta,
        )
        self._pending = False
        self._last_score: float | None = None

    def _score(self, engine: Engine) -> float:
        if callable(self.metric):
            return float(self.metric(engine))
        try:
            return float(engine.state.metrics[self.metric])
        except KeyError:
            known = sorted(engine.state.metrics)
            raise KeyError(
                f"EarlyStopping(metric={self.metric!r}): no such value in engine.state.metrics (it has {known}). "
                "Attach EarlyStopping to the engine that computes the metric, after the metric."
            ) from None

    def __call__(self, engine: Engine) -> None:
        self._last_score = self._score(engine)
        self._pending = self.checker.update(self._last_score)

    def local_values(self) -> tuple[float]:
        return (1.0 if self._pending else 0.0,)

    def on_agreed(self, values: list[list[float]]) -> str | None:
        (votes,) = values
        self._pending = False
        if self.agreement == "rank_zero":
            stop = votes[0] > 0
        elif self.agreement == "any":
            stop = any(v > 0 for v in votes)
        else:
            stop = all(v > 0 for v in votes)
        if not stop:
            return None
        who = [r for r, v in enumerate(votes) if v > 0]
        name = self.metric if isinstance(self.metric, str) else "the score"
        return (
            f"early stopping: {name} did not improve for {self.checker.patience} "
            f"evaluation{'s' if self.checker.patience != 1 else ''} "
            f"(agreement {self.agreement!r}; ranks voting to stop: {who})"
        )

    def sync_engine(self, engine: Engine) -> Engine:
        return self.trainer

    def attach(self, engine: Engine, event: Any = None) -> None:
        """Registers on ``engine`` at ``event``: ``COMPLETED`` of an evaluator by default, or
        ``EPOCH_COMPLETED`` when ``engine`` is the trainer itself. Attaching twice has no effect.

        The verdict always travels in the trainer's sync point.
        """
        if event is None:
            event = Events.EPOCH_COMPLETED if engine is self.trainer else Events.COMPLETED
        if not engine.has_event_handler(self, event):
            engine.add_event_handler(event, self)
        super().attach(engine)

    def state_dict(self) -> dict[str, Any]:
        return {"checker": self.checker.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checker.load_state_dict(state["checker"])
