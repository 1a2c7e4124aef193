"""``checkpoint``: when and how ``unison run`` saves, rotates and resumes checkpoints.

A section of the schema (:mod:`unison.config.schema`), in a module of its own. Its fields
carry the same metadata as :func:`~unison.config.schema.option`'s, for the reference page.
What the keys do is :mod:`unison.recipe.build.assemble`'s (the Checkpoint handler it attaches) and
docs/checkpoints.md's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def _key(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class CheckpointConfig:
    enabled: bool = _key(True, "write checkpoints to <run>/checkpoints")
    every_epochs: int | None = _key(1, "save every this many epochs")
    every_iters: int | None = _key(None, "save every this many iterations")
    every_seconds: float | None = _key(
        None,
        "save once this many seconds of wall time have passed since the last save began (rank 0's clock, "
        "checked at the trainer's sync points): bounds the work a fault loses in time",
    )
    keep_last: int | None = _key(2, "newest checkpoints to keep")
    keep_best: int = _key(1, "best checkpoints (by metric) to keep as well")
    metric: str | None = _key(None, "validation metric ranking checkpoints; default the first metric")
    mode: Literal["max", "min"] | None = _key(
        None,
        "whether a higher or lower metric is better; null: min for a loss-like metric "
        "(loss, *_loss, mse, mae, perplexity ...), else max (the run's plan derives it)",
    )
    async_save: bool = _key(False, "write in a background thread")
    preemption: bool = _key(True, "on SIGTERM/SIGUSR1 save at an agreed iteration and exit 75")
    requeue: bool = _key(False, "under SLURM, requeue the job after a preemption save")
