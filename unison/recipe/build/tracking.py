"""``logging.mlflow`` in a run: the parameters, the tags, the logger, the test metrics.

The store a run writes to is :mod:`unison.recipe.planning.tracking_store`'s rule, computed once into
the run's plan (``plan.tracking``); a sweep's parent run is in :mod:`unison.recipe.sweep.tracking_sweep`.

- :func:`attach_tracking`, on every rank: an :class:`~unison.handlers.mlflow.MLflowLogger`
  with the resolved config as parameters (:func:`~unison.recipe.planning.config_record.params_of`, in the
  plan) and the run's tags
  (:func:`run_tags`); only rank 0 opens the store.
- :func:`log_test_metrics`: the test phase's metrics, into the run training wrote.
"""

from __future__ import annotations

from pathlib import Path

import torch

from unison.config import Config
from unison.distributed import get_rank, get_world_size
from unison.handlers.mlflow import MLflowLogger
from unison.handlers.mlflow_store import key as metric_key
from unison.handlers.mlflow_store import (
    make_client,
    recorded_run,
)
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.config_record import params_of as params_of
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger
from unison.utils.git import git_commit
from unison.utils.version import __version__

_log = get_logger("unison.recipe.run")

RUN_FILE = "mlflow-run.json"
"""In a run folder (and a sweep folder): the MLflow run it writes to, continued on resume."""


def run_tags(config: Config, run_dir: Path | None = None) -> dict[str, str]:
    """World size, backend, strategy, versions, the config's file and the git commit of the
    working folder (MLflow's ``mlflow.source.git.commit``), when :func:`~unison.utils.git.git_commit`
    can read one safely."""
    source = config.origin.file
    return rank_tags(
        str(getattr(config.parallel, "strategy", "ddp")), str(source) if source else None, run_dir
    )


def rank_tags(strategy: str, config_file: str | None, run_dir: Path | None = None) -> dict[str, str]:
    """:func:`run_tags` of a config with ``parallel.strategy`` ``strategy``, read from ``config_file``."""
    dist = torch.distributed
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
    tags = {
        "unison.world_size": str(get_world_size()),
        "unison.backend": backend,
        "unison.strategy": strategy,
        "unison.version": __version__,
        "torch.version": torch.__version__,
    }
    if config_file:
        tags["unison.config"] = config_file
    if run_dir is not None:
        tags["unison.run_dir"] = str(Path(run_dir).resolve())
    commit = git_commit(Path.cwd())
    if commit is not None:
        tags["mlflow.source.git.commit"] = commit
    return tags


def final_artifacts(parts: RunParts, run_dir: Path) -> list[tuple[Path, str | None]]:
    """What ``log_checkpoints`` logs at the end: the config as run, and the best checkpoint (the
    newest without a ranking metric), a file or a sharded checkpoint's folder."""
    out: list[tuple[Path, str | None]] = [(run_dir / "config.yaml", None)]
    checkpoint = parts.checkpoint
    if checkpoint is not None:
        entries = checkpoint.manifest.entries
        entry = checkpoint.best or (entries[-1] if entries else None)
        if entry is not None:
            path = checkpoint.folder / entry.file
            out.append((path, f"checkpoints/{path.name}" if path.is_dir() else "checkpoints"))
    return out


def attach_tracking(plan: RunPlan, parts: RunParts, run_dir: Path) -> MLflowLogger | None:
    """``logging.mlflow``: builds and attaches the MLflow logger; None when it is off.

    Distributed:
        Every rank builds and attaches it alike (it joins the trainer's sync point with
        ``every``); only rank 0 opens the store, at the trainer's ``STARTED``.
    """
    m = plan.logging.mlflow
    if m is None or plan.tracking is None:
        return None
    uri, artifact_location = plan.tracking
    logger = MLflowLogger(
        uri,
        trainer=parts.trainer,
        evaluators={"val": parts.evaluator},
        experiment=m.experiment,
        run_name=m.run_name or run_dir.name,
        params=m.params,
        tags=rank_tags(m.strategy, m.config_file, run_dir),
        parent_run_id=m.parent_run_id,
        every=m.every,
        artifact_location=artifact_location,
        artifacts=(lambda: final_artifacts(parts, run_dir)) if m.log_checkpoints else None,
        run_file=run_dir / RUN_FILE,
    )
    logger.attach(parts.trainer)
    return logger


def log_test_metrics(plan: RunPlan, run_dir: Path, metrics: dict[str, float]) -> None:
    """``logging.mlflow``: the test phase's metrics, as ``test/<name>``, into the run training wrote
    (found through ``<run>/mlflow-run.json``; the run has ended, its status is kept).

    Distributed:
        Call it on every rank; rank 0 alone writes, and nothing is collective.
    """
    if plan.tracking is None or not metrics or get_rank() != 0:
        return
    client = make_client(plan.tracking[0])
    run_id = recorded_run(client, run_dir / RUN_FILE)
    if run_id is None:
        _log.warning(
            "MLflow: no run recorded in %s; the test metrics are not logged there", run_dir / RUN_FILE
        )
        return
    for name, value in metrics.items():
        client.log_metric(run_id, metric_key(f"test/{name}"), float(value))
