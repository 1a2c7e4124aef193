"""``logging.wandb``: how ``unison run`` and ``unison tune`` record runs in Weights & Biases.

A section of the schema (:mod:`unison.config.schema`, hung on ``logging`` by
:mod:`unison.config.logging_config`), in a module of its own. Its fields carry the same
metadata as :func:`~unison.config.schema.option`'s, for the reference page. What the keys do
is :mod:`unison.recipe.build.tracking_wandb`'s (and docs/tracking.md's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def _key(default: Any, doc: str) -> Any:
    metadata = {"doc": doc, "alias": None, "slot": None}
    if isinstance(default, list):
        return field(default_factory=list, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class WandbConfig:
    """One W&B run per ``unison run``, written by rank 0; ``wandb: {}`` takes the defaults."""

    project: str | None = _key(None, "the W&B project; default the config's name")
    entity: str | None = _key(None, "the W&B team or user; default your W&B default entity")
    name: str | None = _key(None, "the W&B run's name; default the run directory's name")
    group: str | None = _key(None, "a W&B group for the run (unison tune sets it to the sweep's)")
    tags: list[str] = _key([], "W&B tags of the run")
    mode: Literal["online", "offline", "disabled"] | None = _key(
        None,
        "online, offline (written under <run>/wandb, sent later with wandb sync) or disabled; "
        "null: WANDB_MODE, else online",
    )
    log_checkpoints: bool = _key(
        False, "at the end, record the newest checkpoint (path and manifest entry) as a reference artifact"
    )
    every: int | None = _key(
        None, "iterations between loss points, read at the trainer's sync points; null: epoch ends only"
    )
