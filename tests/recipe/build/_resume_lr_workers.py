"""Rank functions of tests/recipe/build/test_resume_values.py (``run_distributed`` sends them by name)."""

from __future__ import annotations

import logging
from typing import Any

from unison.config import load_config
from unison.recipe.phases import train_from_config


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def trained_lrs(config: str, resume: str | None, overrides: list[str]) -> dict[str, Any]:
    """Trains (or resumes) the run of ``config``: the lr of every optimizer step, and the log lines."""
    used: list[float] = []
    lines = _Lines()
    logging.getLogger("unison").addHandler(lines)

    def record(parts: Any) -> None:
        parts.optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))

    try:
        results = train_from_config(load_config(config, overrides), resume=resume, attach=record)
    finally:
        logging.getLogger("unison").removeHandler(lines)
    return {"used": used, "log": lines.lines, "run_dir": results["run_dir"]}
