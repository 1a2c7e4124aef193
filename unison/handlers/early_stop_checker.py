"""The decision behind early stopping, apart from any engine or rank."""

from __future__ import annotations

import math
from typing import Any, Literal

Mode = Literal["min", "max"]
ThresholdMode = Literal["abs", "rel"]


class EarlyStopChecker:
    """Decides, score after score, whether training has stopped improving.

    A score improves on the best so far when it is better by more than ``min_delta``:
    with ``threshold_mode="abs"`` by ``min_delta`` itself, with ``"rel"`` by
    ``min_delta x |best|``. After ``patience`` scores in a row without improvement,
    :meth:`update` returns True. With ``cumulative_delta``, the comparison is against the
    score at the last improvement, so many tiny steps that each stay under ``min_delta``
    add up to one improvement once they pass it; without, each score is compared with the
    best score seen (the default, as in most libraries).

    The class knows nothing of ranks or engines; :class:`~unison.handlers.EarlyStopping`
    wires it to an evaluator and makes every rank agree.

    Args:
        patience: how many scores without improvement to accept; the next one stops.
        mode: ``"min"`` when lower is better (a loss), ``"max"`` when higher is (accuracy).
        min_delta: the smallest change that counts as improvement, >= 0.
        threshold_mode: ``"abs"`` or ``"rel"``, how ``min_delta`` is applied.
        cumulative_delta: compare with the score at the last improvement.

    Example:
        >>> checker = EarlyStopChecker(patience=2, mode="max")
        >>> [checker.update(s) for s in (0.5, 0.6, 0.6, 0.59)]
        [False, False, False, True]
    """

    def __init__(
        self,
        patience: int,
        mode: Mode = "min",
        min_delta: float = 0.0,
        threshold_mode: ThresholdMode = "abs",
        cumulative_delta: bool = False,
    ) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopChecker(patience={patience!r}) must be an int >= 1.")
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopChecker(mode={mode!r}) must be 'min' (lower is better) or 'max'.")
        if not isinstance(min_delta, (int, float)) or isinstance(min_delta, bool) or min_delta < 0:
            raise ValueError(f"EarlyStopChecker(min_delta={min_delta!r}) must be a number >= 0.")
        if threshold_mode not in ("abs", "rel"):
            raise ValueError(f"EarlyStopChecker(threshold_mode={threshold_mode!r}) must be 'abs' or 'rel'.")
        self.patience = patience
        self.mode = mode
        self.min_delta = float(min_delta)
        self.threshold_mode = threshold_mode
        self.cumulative_delta = cumulative_delta
        self.reset()

    def reset(self) -> None:
        """Forgets every score seen."""
        self.best: float | None = None
        self.counter = 0
        self.stopped = False

    def _better(self, score: float, reference: float, margin: float = 0.0) -> bool:
        if self.mode == "min":
            return score < reference - margin
        return score > reference + margin

    def update(self, score: float) -> bool:
        """Takes the next score; returns True when patience has run out."""
        score = float(score)
        if math.isnan(score):
            raise ValueError(
                "EarlyStopChecker got a NaN score; the metric it watches is undefined (did training "
                "diverge?). Stop on non-finite losses with unison.handlers.NonFiniteGuard."
            )
        if self.best is None:
            self.best = score
            return self.stopped
        margin = self.min_delta if self.threshold_mode == "abs" else self.min_delta * abs(self.best)
        if self._better(score, self.best, margin):
            self.best = score
            self.counter = 0
        else:
            # A better score that misses the margin becomes the new reference unless
            # small steps are meant to add up (cumulative_delta).
            if not self.cumulative_delta and self._better(score, self.best):
                self.best = score
            self.counter += 1
            if self.counter >= self.patience:
                self.stopped = True
        return self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "counter": self.counter, "stopped": self.stopped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.counter = int(state["counter"])
        self.stopped = bool(state["stopped"])
