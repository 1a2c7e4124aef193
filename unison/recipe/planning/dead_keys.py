"""Keys that change nothing: arguments given for an object the config does not build.

``training.scheduler_kwargs`` are the scheduler's arguments; without
``training.scheduler_type`` no scheduler is built and they are read by nothing. The same
holds for early stopping's ``kwargs`` and ``args`` without ``early_stopping.patience``. A
run refuses such a config (:func:`unowned`, called by :func:`~unison.recipe.planning.resolved.resolve`),
as the schema refuses other keys that would be silently ignored (an unknown key,
``prefetch_factor`` without workers, an early stopping ``type`` without patience): a value
the user wrote and believes in must not be dropped without a word. A sweep refuses a
search-space key that changes nothing (:func:`changes_nothing`, called by
:func:`~unison.recipe.sweep.space.check_space`): every trial would train alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unison.config import Config


@dataclass(frozen=True)
class Owner:
    """A key (``owner``) without which the keys of ``owned`` are read by nothing."""

    owner: str
    owned: tuple[str, ...]
    """Dotted keys; the mappings and lists among them are refused by a run when given."""
    what: str
    """What the owner builds, for messages: ``no scheduler is built``."""
    example: str
    """How to set the owner, for messages."""


OWNERS = (
    Owner(
        "training.scheduler_type",
        ("training.scheduler_kwargs", "training.scheduler_every"),
        "no scheduler is built",
        "scheduler_type: !pyobject torch.optim.lr_scheduler.StepLR",
    ),
    Owner(
        "early_stopping.patience",
        (
            "early_stopping.kwargs",
            "early_stopping.args",
            "early_stopping.metric",
            "early_stopping.mode",
            "early_stopping.min_delta",
            "early_stopping.threshold_mode",
            "early_stopping.cumulative_delta",
            "early_stopping.agreement",
        ),
        "early stopping is off",
        "patience: 5",
    ),
)
"""Each key whose value is read only when another key is set."""

OVERRIDDEN = {"training.optimizer_kwargs.lr": "training.lr"}
"""A key whose value is replaced by another key's, when that one is set."""


def _value(config: Config, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _owner_of(dotted: str) -> Owner | None:
    for owner in OWNERS:
        if any(dotted == key or dotted.startswith(key + ".") for key in owner.owned):
            return owner
    return None


def unowned(config: Config) -> tuple[str, str] | None:
    """The first mapping or list of arguments the config gives for an object it does not build, as
    ``(its dotted key, the message)``; None when every one has its owner."""
    for owner in OWNERS:
        if _value(config, owner.owner) is not None:
            continue
        for key in owner.owned:
            value = _value(config, key)
            if isinstance(value, (dict, list)) and value:
                return key, (
                    f"{value!r} is given, but {owner.owner} is not set, so {owner.what} and {key} changes "
                    f"nothing. Set {owner.owner} ({owner.example}), or remove {key}"
                )
    return None


def changes_nothing(config: Config, dotted: str) -> str | None:
    """Why setting the key ``dotted`` (a search space's key) in ``config`` changes nothing, or None."""
    owner = _owner_of(dotted)
    if owner is not None and _value(config, owner.owner) is None:
        return f"{owner.owner} is not set, so {owner.what} ({owner.example} would build it)"
    by = OVERRIDDEN.get(dotted)
    if by is not None and _value(config, by) is not None:
        return f"{by} is set ({_value(config, by)!r}) and replaces it"
    return None
