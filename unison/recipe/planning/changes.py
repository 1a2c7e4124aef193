"""What changed in a config since the run it resumes: applied and recorded, or refused."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from unison.config import Config, Origin, load_config, to_plain
from unison.recipe.planning.scheduler_resume import PREFIX, how_applied, refusal
from unison.utils import get_logger
from unison.utils.run_files import write_text
from unison.utils.secrets import redact

_log = get_logger("unison.recipe.run")  # the run's logger

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
    """One key whose value differs from the saved run's; ``applied``: how it takes effect over the
    checkpoint's saved state, where that needs saying (a scheduler's keyword)."""

    key: str
    old: Any
    new: Any
    applied: str | None = None

    def __str__(self) -> str:
        how = f" (applied: {self.applied})" if self.applied else ""
        return f"{self.key} {self.old!r} -> {self.new!r}{how}"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def config_changes(old: Config | dict[str, Any], new: Config | dict[str, Any]) -> list[Change]:
    """Every key (as a dotted path) whose value differs between two configs (or their records), in
    key order.

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


def check_resume(
    record: dict[str, Any], origin: Origin, run_dir: Path, scheduler_type: Any = None
) -> list[Change]:
    """The changes of a config since the run saved in ``run_dir``; refuses those no checkpoint can
    follow. ``record`` and ``origin``: the config's redacted record and origin (the plan's
    ``record`` and ``refs.origin``); ``scheduler_type``: the resolved ``training.scheduler_type``.

    Reads ``run_dir/config.yaml`` (what that run trained with) and compares it with ``record``. Nothing is imported or
    called: the saved config is only compared. A key of ``training.scheduler_kwargs`` is
    applied over the scheduler's saved state or refused, as ``scheduler_type`` (the resolved
    ``training.scheduler_type``) decides (:mod:`unison.recipe.planning.scheduler_resume`).

    Raises:
        ConfigError: naming every key that cannot change on resume, with both values.
    """
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return []
    changes = [
        _scheduler_change(c, scheduler_type, origin) for c in config_changes(load_config(saved), record)
    ]
    blocking = [c for c in changes if _blocks(c)]
    if blocking:
        listed = "; ".join(str(c) for c in blocking)
        raise origin.error(
            tuple(blocking[0].key.split(".")),
            f"cannot resume the run in {run_dir} with this config: {listed}. The checkpoint holds weights, "
            "optimizer state and a data position made with the saved values. Put them back (see "
            f"{saved}), or start a new run (leave out --resume).",
        )
    return changes


def _scheduler_change(change: Change, scheduler_type: Any, origin: Origin) -> Change:
    """``change`` with how it is applied, when it is a scheduler's keyword; refused when it cannot be."""
    if not change.key.startswith(PREFIX) or scheduler_type is None:
        return change
    name = change.key[len(PREFIX) :].split(".")[0]
    how = how_applied(name, change.old, change.new, scheduler_type)
    if how is None:
        raise origin.error(
            tuple(change.key.split(".")), refusal(name, change.old, change.new, scheduler_type)
        )
    return replace(change, applied=how)


def record(run_dir: Path, changes: list[Change]) -> None:
    """Appends one line to ``run_dir/changes-on-resume.jsonl``: when, and what changed (and, for a
    scheduler's keyword, how it was applied)."""
    listed = [{k: v for k, v in vars(c).items() if k != "applied" or v is not None} for c in changes]
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changes": listed}
    write_text(run_dir / CHANGES_FILE, json.dumps(line, default=str) + "\n", "a")  # never through a link


def record_changes(plain: dict[str, Any], origin: Origin, run_dir: Path, scheduler_type: Any) -> None:
    """Rank 0: logs and records what changed since the saved run (refusals happened before spawn);
    ``plain``: the config's redacted record (the plan's ``record``)."""
    changes = check_resume(plain, origin, run_dir, scheduler_type)
    for change in changes:
        _log.warning("changed on resume: %s", change)
    if changes:
        record(run_dir, changes)
