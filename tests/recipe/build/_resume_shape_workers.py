"""The rank function of tests/recipe/build/test_resume_shape.py (``run_distributed`` sends it by name)."""

from __future__ import annotations

from typing import Any

from unison.config import load_config
from unison.recipe.phases import train_from_config


def train(config: str) -> dict[str, Any]:
    """Trains the run of ``config`` on this rank: its results but the history."""
    results = train_from_config(load_config(config))
    return {k: v for k, v in results.items() if k != "history"}
