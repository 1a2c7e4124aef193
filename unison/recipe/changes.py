"""What changed in a config since the run it resumes: applied and recorded, or refused."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.config import Config, load_config, to_plain
from unison.utils.run_files import write_text
from unison.utils.secrets import redact

NOT_RESUMABLE = (
    "model",
    "data",
    "training.loss",
    "training.optimizer_type",
    "training.scheduler_type",
)
"""Keys whose change a checkpoint cannot follow: the saved weights, optimizer state and
schedule belong to what these name (a model of another shape, other data behind the saved
sampler position). Any other change (learning rate, epochs, logging, world size) resumes."""

CHANGES_FILE = "changes-on-resume.jsonl"
"""Where rank 0 records each resume's changes, one JSON line per resume, in the run folder."""


@dataclass(frozen=True)
class Change:
    """One key whose value differs from the saved run's."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def config_changes(old: Config, new: Config) -> list[Change]:
    """Every key (as a dotted path) whose value differs between two configs, in key order.

    Example:
        >>> old, new = Config(), Config()
        >>> new.training.max_epochs = old.training.max_epochs + 5
        >>> [str(c) for c in config_changes(old, new)]
        ['training.max_epochs 10 -> 15']
    """
    # Compared as saved: a saved config.yaml holds URLs with their credentials masked.
    before, after = _flatten(redact(to_plain(old))), _flatten(redact(to_plain(new)))
    missing = object()
    return [
        Change(key, before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys())
        if before.get(key, missing) != after.get(key, missing)
    ]


def _blocks(change: Change) -> bool:
    return any(change.key == k or change.key.startswith(k + ".") for k in NOT_RESUMABLE)


def check_resume(config: Config, run_dir: Path) -> list[Change]:
    """The changes since the run saved in ``run_dir``; refuses those no checkpoint can follow.

    Reads ``run_dir/config.yaml`` (what that run trained with). Nothing is imported or
    called: the saved config is only compared.

    Raises:
        ConfigError: naming every key that cannot change on resume, with both values.
    """
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return []
    changes = config_changes(load_config(saved), config)
    blocking = [c for c in changes if _blocks(c)]
    if blocking:
        listed = "; ".join(str(c) for c in blocking)
        raise config.origin.error(
            tuple(blocking[0].key.split(".")),
            f"cannot resume the run in {run_dir} with this config: {listed}. The checkpoint holds weights, "
            "optimizer state and a data position made with the saved values. Put them back (see "
            f"{saved}), or start a new run (leave out --resume).",
        )
    return changes


def record(run_dir: Path, changes: list[Change]) -> None:
    """Appends one line to ``run_dir/changes-on-resume.jsonl``: when, and what changed."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changes": [vars(c) for c in changes]}
    write_text(run_dir / CHANGES_FILE, json.dumps(line, default=str) + "\n", "a")  # never through a link
