"""``logging.wandb`` planned once: the W&B run's settings and the config it records.

:func:`wandb_plan` is what :func:`~unison.recipe.planning.step_plans.logging_plan` computes for
``logging.wandb``; :mod:`unison.recipe.build.tracking_wandb` builds the logger from it.
:func:`check_wandb` is the plan's check of the section (W&B installed, names given, ``every``
at sync points, its tags).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from unison.config import Config, ConfigError
from unison.handlers.wandb import Mode
from unison.recipe.planning.config_record import config_record
from unison.recipe.planning.tracking_store import check_tracker

PYOBJECT = "!pyobject "
EXTRA = "pip install 'unison[wandb]'"


@dataclass(frozen=True)
class WandbPlan:
    """``logging.wandb``'s run: project (default the config's name), entity, name (None: the run
    folder's), group, tags, mode, period, whether the checkpoint is recorded, and the config."""

    project: str
    entity: str | None
    name: str | None
    group: str | None
    tags: tuple[str, ...]
    mode: Mode | None
    every: int | None
    log_checkpoints: bool
    config: dict[str, Any]


def flat_config(config: Config) -> dict[str, Any]:
    """The resolved config as a W&B run's config: dotted keys (``training.lr``), values as they
    are (numbers stay numbers, lists stay lists), a ``!pyobject`` as its dotted path, URL
    credentials masked (:func:`~unison.recipe.planning.config_record.config_record`'s copy)."""
    out: dict[str, Any] = {}

    def plain(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(PYOBJECT):
            return value[len(PYOBJECT) :]
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping) and value:
            for name, item in value.items():
                walk(item, f"{key}.{name}" if key else str(name))
        else:
            out[key] = {} if isinstance(value, Mapping) else plain(value)

    walk(config_record(config), "")
    return out


def wandb_plan(config: Config) -> WandbPlan | None:
    """``config``'s :class:`WandbPlan`; None when ``logging.wandb`` is off."""
    w = config.logging.wandb
    if w is None:
        return None
    return WandbPlan(
        project=w.project or config.name,
        entity=w.entity,
        name=w.name,
        group=w.group,
        tags=tuple(w.tags),
        mode=w.mode,
        every=w.every,
        log_checkpoints=w.log_checkpoints,
        config=flat_config(config),
    )


def _error(config: Config, key: str, message: str) -> ConfigError:
    return config.origin.error(tuple(key.split(".")), message)


def check_wandb(config: Config) -> None:
    """With ``logging.wandb`` set: :func:`~unison.recipe.planning.tracking_store.check_tracker`, and every
    tag is a non-empty string.

    Raises:
        ConfigError: naming the key (file and line), the value and the fix.
    """
    missing = f"Weights & Biases is not installed here: {EXTRA}"
    w = check_tracker(config, "wandb", "wandb", missing, ("project", "entity", "name", "group"))
    for n, tag in enumerate([] if w is None else w.tags):
        if not isinstance(tag, str) or not tag.strip():
            raise _error(config, f"logging.wandb.tags.{n}", f"tag {tag!r} must be a non-empty string")
