"""``training.profile``: the window of iterations ``unison run`` traces with ``torch.profiler``.

A section of the schema (:mod:`unison.config.schema`), in a module of its own. Its fields
carry the same metadata as :func:`~unison.config.schema.option`'s, for the reference page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _key(default: int, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class ProfileConfig:
    """Every rank traces ``active`` iterations after skipping ``wait`` and warming up on ``warmup``;
    the traces go to ``<run>/tb/plugins/profile/`` (``unison run --profile [ACTIVE]``)."""

    wait: int = _key(1, "iterations skipped before the profiler warms up (>= 0)")
    warmup: int = _key(1, "iterations traced and thrown away: the profiler's own start-up cost (>= 0)")
    active: int = _key(3, "iterations recorded in each rank's trace (>= 1)")
    repeat: int = _key(1, "windows of wait + warmup + active recorded one after another (>= 1)")
