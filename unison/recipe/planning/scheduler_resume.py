"""A changed ``training.scheduler_kwargs`` on resume: applied on the loaded scheduler, or refused.

Loading a checkpoint puts the scheduler's saved state back: its attributes, the keyword
arguments it was built with among them, over those of this run's config. A change the run
reports must have an effect, so each key is decided once, by the scheduler that takes it:

- **set on the loaded scheduler** (:data:`SET_AFTER_LOADING`): a parameter that each step reads
  afresh, such as ``StepLR``'s ``step_size`` and ``gamma``, ``MultiStepLR``'s ``milestones``,
  ``ReduceLROnPlateau``'s ``factor`` and ``patience``. The schedule continues from where it had
  reached with the new value;
- **the schedule rescaled** (:data:`RESCALED`): ``OneCycleLR``'s ``max_lr``. Every rate of a one
  cycle is proportional to it, so multiplying each by new/old gives the new schedule at the step
  reached (:func:`~unison.handlers.lr_scaling.rebase_lr`, with ``training.lr_scaling``'s scale);
- **refused** before any rank starts, naming the key: any other key, which changes the
  schedule's shape mid-way (``OneCycleLR``'s ``total_steps``, ``CosineAnnealingLR``'s ``T_max``,
  ``CyclicLR``, ``LinearLR``) or that unison cannot tell (a scheduler of another library).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Mapping
from typing import Any

from unison.utils import get_logger

_log = get_logger("unison.recipe.run")

PREFIX = "training.scheduler_kwargs."

SET_AFTER_LOADING: dict[str, dict[str, str]] = {
    "StepLR": {"step_size": "step_size", "gamma": "gamma"},
    "MultiStepLR": {"milestones": "milestones", "gamma": "gamma"},
    "ExponentialLR": {"gamma": "gamma"},
    "CosineAnnealingLR": {"eta_min": "eta_min"},
    "ReduceLROnPlateau": {
        "factor": "factor",
        "patience": "patience",
        "threshold": "threshold",
        "cooldown": "cooldown",
        "eps": "eps",
        "min_lr": "min_lrs",
    },
}
"""torch schedulers, each keyword whose new value is set on the loaded scheduler (and its attribute)."""

RESCALED = {"OneCycleLR": "max_lr"}
"""torch schedulers whose every rate is proportional to one keyword: a change rescales the schedule."""


def torch_scheduler(scheduler_type: Any) -> str | None:
    """The name of the torch scheduler ``scheduler_type`` is (or derives from), None for another."""
    for cls in getattr(scheduler_type, "__mro__", ()):
        if cls.__module__.startswith("torch.optim") and (
            cls.__name__ in SET_AFTER_LOADING or cls.__name__ in RESCALED
        ):
            return str(cls.__name__)
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def how_applied(name: str, old: Any, new: Any, scheduler_type: Any) -> str | None:
    """How a change of ``training.scheduler_kwargs.<name>`` from ``old`` to ``new`` takes effect on
    resume, as a phrase for the record; None when it cannot (the change is refused).

    Example:
        >>> from torch.optim.lr_scheduler import OneCycleLR, StepLR
        >>> how_applied("gamma", 0.5, 0.1, StepLR)
        'set on the loaded StepLR: it steps with the new value from where the schedule had reached'
        >>> how_applied("total_steps", 12, 24, OneCycleLR) is None
        True
    """
    kind = torch_scheduler(scheduler_type)
    if kind is None:
        return None
    if name in SET_AFTER_LOADING.get(kind, {}):
        return f"set on the loaded {kind}: it steps with the new value from where the schedule had reached"
    if RESCALED.get(kind) == name and _number(old) and _number(new) and old > 0:
        return f"every rate of the loaded {kind} multiplied by {new / old:g}: the new schedule, at the step reached"
    return None


def refusal(name: str, old: Any, new: Any, scheduler_type: Any) -> str:
    """Why a change of ``training.scheduler_kwargs.<name>`` cannot follow a checkpoint, and what to do."""
    kind = str(torch_scheduler(scheduler_type) or getattr(scheduler_type, "__name__", scheduler_type))
    settable = sorted(SET_AFTER_LOADING.get(kind, {})) + ([RESCALED[kind]] if kind in RESCALED else [])
    can = f"; of its keys, {', '.join(settable)} can change on resume" if settable else ""
    return (
        f"{old!r} -> {new!r} on resume: {kind} keeps it in the state the checkpoint loads back, and a new "
        f"value would change the schedule's shape where it stands{can}. Put the saved value back, or start "
        "a new run (leave out --resume)"
    )


def apply_scheduler_changes(
    scheduler: Any, old: Mapping[str, Any], new: Mapping[str, Any], scheduler_type: Any
) -> None:
    """Sets the changed keywords of :data:`SET_AFTER_LOADING` on ``scheduler``, after its state loaded
    (the rescaled ones move with the learning rate: :mod:`unison.recipe.build.resume_values`).

    ``old`` and ``new``: the scheduler's keyword arguments as the saved run and this run give them.
    """
    kind = torch_scheduler(scheduler_type)
    settable = SET_AFTER_LOADING.get(kind or "", {})
    for name in sorted((old.keys() | new.keys()) & settable.keys()):
        if old.get(name) == new.get(name):
            continue
        value = new[name] if name in new else _default(scheduler_type, name)
        attribute = settable[name]
        setattr(scheduler, attribute, _as_attribute(scheduler, attribute, value))
        _log.info("scheduler %s on resume: %r (changed from %r)", name, value, old.get(name))


def _default(scheduler_type: Any, name: str) -> Any:
    return inspect.signature(scheduler_type).parameters[name].default


def _as_attribute(scheduler: Any, attribute: str, value: Any) -> Any:
    """``value`` as the scheduler keeps it: milestones counted, a minimum per parameter group."""
    if attribute == "milestones":
        return Counter(value)
    if attribute == "min_lrs":
        groups = len(scheduler.optimizer.param_groups)
        return list(value) if isinstance(value, (list, tuple)) else [value] * groups
    return value
