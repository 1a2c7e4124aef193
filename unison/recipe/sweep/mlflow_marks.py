"""How a sweep's trials ended, in MLflow: each trial's run says its state, the sweep's run the best.

With ``logging.mlflow``, every trial trains into a run nested under the sweep's run
(:func:`~unison.recipe.sweep.tracking_sweep.sweep_tracking`). Rank 0 ends that run FINISHED when training
returns, whatever the study makes of it; the sweep process, which tells the study how the
trial ended, tells MLflow too (:func:`mark_trial`):

========== =========================== ==========================
study      ``optuna.trial.state`` tag  run status
========== =========================== ==========================
COMPLETE   ``COMPLETE``                ``FINISHED``
PRUNED     ``PRUNED``                  ``KILLED`` (stopped early)
FAIL       ``FAIL``                    ``FAILED``
========== =========================== ==========================

with ``optuna.trial.number`` (and ``optuna.trial.value`` when COMPLETE). At the end of the
sweep its own run gets the best trial (:func:`mark_best`): tags ``optuna.best_trial.number``
and ``optuna.best_trial.value``, and the metric ``best/val/<metric>``.

Marking is bookkeeping: a store that cannot be reached gives a warning, never a failed sweep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unison.handlers.mlflow_store import key, make_client, recorded_run
from unison.recipe.build.tracking import RUN_FILE
from unison.recipe.sweep.tracking_sweep import SweepRun
from unison.utils import get_logger

_log = get_logger("unison.recipe.sweep.study")

STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
"""The MLflow run status of a trial's run, by the trial's state in the study."""


def mark_trial(sweep: SweepRun | None, run_dir: Path | None, record: dict[str, Any]) -> None:
    """Sets the trial's state (``record["state"]``) on the MLflow run recorded in ``run_dir``: the
    ``optuna.trial.*`` tags and the run's status. Nothing without a sweep run or a recorded run."""
    if sweep is None or run_dir is None:
        return
    state = str(record.get("state", "FAIL"))
    try:
        client = make_client(sweep.tracking_uri)
        run_id = recorded_run(client, run_dir / RUN_FILE)
        if run_id is None:  # the trial ended before rank 0 opened its run
            return
        client.set_tag(run_id, "optuna.trial.state", state)
        client.set_tag(run_id, "optuna.trial.number", str(record.get("number")))
        if state == "COMPLETE":
            client.set_tag(run_id, "optuna.trial.value", repr(float(record["value"])))
        if client.get_run(run_id).info.end_time is None:  # its ranks never ended it
            client.set_terminated(run_id, STATUS[state])
        else:
            client.update_run(run_id, status=STATUS[state])
    except Exception as err:
        _log.warning(
            "MLflow: trial %s's run not marked %s: %s: %s",
            record.get("number"),
            state,
            type(err).__name__,
            err,
        )


def mark_best(sweep: SweepRun | None, study: Any, metric: str) -> None:
    """Sets the study's best trial on the sweep's run: its number and value as tags, the value as the
    metric ``best/val/<metric>``. Nothing without a sweep run or a COMPLETE trial."""
    if sweep is None:
        return
    try:
        best = study.best_trial
    except ValueError:  # no COMPLETE trial yet
        return
    try:
        client = make_client(sweep.tracking_uri)
        client.set_tag(sweep.run_id, "optuna.best_trial.number", str(best.number))
        client.set_tag(sweep.run_id, "optuna.best_trial.value", repr(float(best.value)))
        client.log_metric(sweep.run_id, key(f"best/val/{metric}"), float(best.value), step=best.number)
    except Exception as err:
        _log.warning("MLflow: the sweep's run not given its best trial: %s: %s", type(err).__name__, err)
