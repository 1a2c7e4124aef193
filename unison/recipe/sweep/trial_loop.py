"""The loop of a sweep: Optuna's own ``study.optimize``, stopped by what the study holds.

The study is counted from its storage after every trial (Optuna's ``MaxTrialsCallback`` over
the COMPLETE and PRUNED states): several ``unison tune`` processes on one study stop together,
and a FAIL trial is replaced. After ``trials`` FAIL trials in one call the loop gives up and the
study is *short* (``unison tune`` exits 1). A sampler that runs out of values (``GridSampler``,
``BruteForceSampler``) stops the loop from inside it, which Optuna allows only there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from unison.recipe.sweep.space import import_optuna
from unison.recipe.sweep.storage import optuna_quiet
from unison.utils import get_logger

_log = get_logger("unison.recipe.sweep.study")


class _Ended(Exception):
    """Carries a ``SystemExit`` (the ranks' exit code) through Optuna's loop, which marks the trial FAIL
    for an ``Exception`` only; re-raised as it was once the loop has ended."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        super().__init__(str(cause))


def finished(by_state: dict[str, int]) -> int:
    return by_state.get("COMPLETE", 0) + by_state.get("PRUNED", 0)


def used_up(study: Any) -> bool:
    """Whether the study's sampler has nothing left to draw (a grid whose every point has run)."""
    exhausted = getattr(study.sampler, "is_exhausted", None)
    return bool(exhausted(study)) if callable(exhausted) else False


class Loop:
    """Optuna's own loop (``study.optimize``), stopped when the study holds ``trials`` finished trials.

    The count is read from the storage after every trial (Optuna's ``MaxTrialsCallback`` over the
    COMPLETE and PRUNED states), so several ``unison tune`` processes on one study stop together; a
    FAIL trial is replaced, and after ``trials`` FAIL trials in one call the sweep gives up. A sampler
    that runs out of values (``GridSampler``, ``BruteForceSampler``) ends the loop from inside it.
    """

    def __init__(self, trials: int) -> None:
        self.trials = trials
        self.failed = 0
        self.counted = False

    def run(
        self, study: Any, run_one: Callable[[Any], dict[str, Any]], records: list[dict[str, Any]]
    ) -> None:
        """Runs trials in ``study.optimize``; ``run_one(trial)`` runs one and returns its record
        (its ``state``, and ``value`` when COMPLETE), or raises what ended it (the trial is FAIL)."""
        optuna = import_optuna()
        from optuna.trial import TrialState

        def objective(trial: Any) -> float:
            try:
                record = run_one(trial)
            except (Exception, KeyboardInterrupt):
                raise  # Optuna marks the trial FAIL and raises it on
            except BaseException as err:  # SystemExit: the ranks' exit code
                raise _Ended(err) from None
            records.append(record)
            if record["state"] == "PRUNED":
                raise optuna.TrialPruned(f"pruned after epoch {record['pruned_at_epoch']}")
            return float(record["value"]) if record["state"] == "COMPLETE" else math.nan  # nan: FAIL

        enough = optuna.study.MaxTrialsCallback(self.trials, states=(TrialState.COMPLETE, TrialState.PRUNED))

        def count(study: Any, trial: Any) -> None:
            self.failed += trial.state == TrialState.FAIL
            if self.failed >= self.trials:
                self.counted = True
                study.stop()
            enough(study, trial)

        try:
            with optuna_quiet():
                study.optimize(objective, callbacks=[count], gc_after_trial=False)
        except _Ended as ended:
            raise ended.cause from None


def short_of(study: Any, trials: int, loop: Loop) -> str | None:
    """Why the study holds fewer than ``trials`` finished trials after this sweep, or None."""
    found = counts(study)
    if finished(found) >= trials:
        return None
    if loop.counted:
        return (
            f"{loop.failed} trials failed in this sweep; the study holds {finished(found)} finished trials of "
            f"--trials {trials}. See the trials' trial.json and logs; unison tune again runs the rest"
        )
    if used_up(study) or not loop.failed:
        _log.warning(
            "the sampler %s has no values left to draw: the study holds %d finished trials of --trials %d",
            type(study.sampler).__name__,
            finished(found),
            trials,
        )
        return None
    return f"the study holds {finished(found)} finished trials of --trials {trials}"


def counts(study: Any) -> dict[str, int]:
    """The study's trials by state: ``{"COMPLETE": 3, "PRUNED": 1, ...}``."""
    out: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        out[trial.state.name] = out.get(trial.state.name, 0) + 1
    return out
