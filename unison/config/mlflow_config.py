"""``logging.mlflow``: where and how ``unison run`` and ``unison tune`` record runs in MLflow.

A section of the schema (:mod:`unison.config.schema`), in a module of its own. Its fields
carry the same metadata as :func:`~unison.config.schema.option`'s, for the reference page.
What the keys do is :mod:`unison.recipe.build.tracking`'s (and docs/tracking.md's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _key(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class MLflowConfig:
    """One MLflow run per ``unison run``, written by rank 0; ``mlflow: {}`` takes the defaults."""

    tracking_uri: str | None = _key(
        None,
        "null: the SQLite file <root>/mlflow.db (artefacts in <root>/mlartifacts); a file path inside "
        "<root>; or a URL of your choice (https://..., databricks, sqlite:////abs/path.db)",
    )
    experiment: str | None = _key(None, "the MLflow experiment; default the config's name")
    run_name: str | None = _key(None, "the MLflow run's name; default the run directory's name")
    parent_run_id: str | None = _key(None, "an MLflow run to nest this run under (unison tune sets it)")
    log_checkpoints: bool = _key(False, "at the end, log the best checkpoint and the config as artefacts")
    every: int | None = _key(
        None, "iterations between loss points, read at the trainer's sync points; null: epoch ends only"
    )
