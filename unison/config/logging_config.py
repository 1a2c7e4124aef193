"""``logging``: the run folder, TensorBoard, the progress bar, and the trackers' sections.

A section of the schema (:mod:`unison.config.schema`), in a module of its own so that each
tracker's section (:mod:`~unison.config.mlflow_config`, :mod:`~unison.config.wandb_config`)
hangs here. Its fields carry the same metadata as :func:`~unison.config.schema.option`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unison.config.mlflow_config import MLflowConfig
from unison.config.wandb_config import WandbConfig


def _key(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class LoggingConfig:
    root: str = _key("runs", "runs go to <root>/<name>/<timestamp>/")
    tensorboard: bool = _key(True, "write TensorBoard event files to <run>/tb")
    progress: bool = _key(True, "a progress bar on rank 0")
    log_every: int = _key(50, "iterations between learning-rate points in TensorBoard")
    mlflow: MLflowConfig | None = _key(
        None, "track the run in MLflow from rank 0 (docs/tracking.md); null: off"
    )
    wandb: WandbConfig | None = _key(
        None, "track the run in Weights & Biases from rank 0 (docs/tracking.md); null: off"
    )
