"""``unison tune`` with ``logging.mlflow``: the sweep's parent run, and the ``--set`` keys that
nest each trial's run under it, in the same experiment.

- :func:`sweep_tracking`: the parent run, opened by the sweep process;
- :func:`trial_overrides`: a trial's store, experiment, run name and parent run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

from unison.handlers.mlflow_store import limited, make_client, open_experiment, record_run, recorded_run
from unison.recipe.build.tracking import RUN_FILE, params_of, run_tags
from unison.recipe.planning.tracking_store import check_mlflow, store
from unison.recipe.sweep.space import SweepPlan
from unison.utils import get_logger
from unison.utils.secrets import redact_url

_log = get_logger("unison.recipe.run")


@dataclass(frozen=True)
class SweepRun:
    """A sweep's parent run: where it is, and its id."""

    tracking_uri: str
    experiment: str
    run_id: str


def trial_overrides(sweep: SweepRun | None, number: int) -> list[str]:
    """``--set`` keys for trial ``number``: the sweep's store and experiment, its own run name,
    nested under the sweep's run. Empty without a sweep run."""
    if sweep is None:
        return []
    values = {
        "tracking_uri": sweep.tracking_uri,
        "experiment": sweep.experiment,
        "run_name": f"trial-{number:04d}",
        "parent_run_id": sweep.run_id,
    }
    return [f"logging.mlflow.{key}={json.dumps(value)}" for key, value in values.items()]


@contextlib.contextmanager
def sweep_tracking(plan: SweepPlan) -> Iterator[SweepRun | None]:
    """``unison tune`` with ``logging.mlflow``: the sweep's parent run, opened by the sweep process
    (continued by a later ``unison tune`` of the same sweep folder) and ended FINISHED, or FAILED
    when the sweep ends with an error. Yields None when ``logging.mlflow`` is off."""
    config = plan.config
    m = config.logging.mlflow
    if m is None:
        yield None
        return
    check_mlflow(config)
    uri, artifact_location = store(config)
    experiment = m.experiment or config.name
    client = make_client(uri)
    record = plan.folder / RUN_FILE
    run_id = recorded_run(client, record)
    if run_id is None:
        tags = {**run_tags(config), "unison.sweep": str(plan.folder), "unison.study": plan.study_name}
        run = client.create_run(
            open_experiment(client, experiment, artifact_location),
            run_name=f"tune-{plan.study_name}",
            tags=tags,
        )
        run_id = run.info.run_id
        from mlflow.entities import Param

        client.log_batch(run_id, params=[Param(k, v) for k, v in limited(params_of(config)).items()])
        record_run(record, run_id, uri)
    else:
        client.update_run(run_id, status="RUNNING")
    _log.info("MLflow: sweep run %s in experiment %r at %s", run_id, experiment, redact_url(uri))
    status = "FAILED"
    try:
        yield SweepRun(uri, experiment, run_id)
        status = "FINISHED"
    finally:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, status)
