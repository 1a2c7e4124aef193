"""Each rank's batch size at a run's world size: ``batch_size`` per rank, or ``global_batch_size``.

``training.batch_size`` is the samples each rank takes per step (one forward and backward), as
QuantumGrav's configs and DDP mean it: at N ranks an optimizer update sees ``batch_size x N x
accumulation_steps`` samples. ``training.global_batch_size`` names that product instead, the
samples of one optimizer update across all ranks, as DeepSpeed's ``train_batch_size``,
Megatron's ``global_batch_size`` and the "total batch size" Accelerate and the Hugging Face
Trainer log mean it: at ``world_size`` ranks each rank takes ``global_batch_size / (world_size x
accumulation_steps)`` per step, so a run at 1 rank and one at 8 see the same samples per update.
``validation.global_batch_size``, ``testing.global_batch_size`` and ``predict.global_batch_size``
are the samples of one evaluation (or prediction) step across all ranks (no accumulation there):
``global / world_size`` per rank.

A section gives one or the other. When the file gives one and ``--set`` the other, the command
line wins (as it does for a key written under two names); both in the file, both on the command
line, or both set in Python is refused. A size that does not divide is refused when the world
size is known (:func:`batch_sizes`, before any rank is spawned), naming the key, its line, the
world size and the sizes and world sizes that would divide.

``data.build`` learns the world size when it asks for it: a builder with a parameter named
``world_size`` (:func:`asks_world_size`) is called with the run's, on every rank, as it is with
the seed (to build a per-rank share of its own, or size something by the ranks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unison.config.origin import Origin
from unison.config.schema import Config

DEFAULT_BATCH_SIZE = 32
"""Samples per rank per step when a section gives neither ``batch_size`` nor ``global_batch_size``."""

SECTIONS = ("training", "validation", "testing", "predict")
"""The sections that take a ``global_batch_size``."""

GLOBAL_MEANS = (
    "samples per optimizer update across all ranks = the per-rank batch x ranks x accumulation_steps"
)


@dataclass(frozen=True)
class BatchSizes:
    """Each section's batch size per rank at ``world_size`` ranks, every default applied.

    Attributes:
        world_size: the ranks these sizes are for.
        training: samples per rank per step (a micro-batch, with accumulation).
        validation: per rank; default the training one.
        testing: per rank; default the validation one.
        predict: per rank (``predict.batch_size`` or ``predict.global_batch_size``); default the
            validation one.
    """

    world_size: int
    training: int
    validation: int
    testing: int
    predict: int

    def per_update(self, accumulation_steps: int) -> int:
        """Samples of one optimizer update across all ranks.

        Example:
            >>> BatchSizes(4, 8, 8, 8, 8).per_update(2)
            64
        """
        return self.training * self.world_size * accumulation_steps


def batch_sizes(config: Config, world_size: int) -> BatchSizes:
    """Every section's batch size per rank at ``world_size`` ranks.

    Raises:
        ConfigError: at a ``global_batch_size`` that does not divide over ``world_size`` ranks (and
            ``training.accumulation_steps``), or a section that gives both keys.

    Example:
        >>> c = Config()
        >>> c.training.batch_size, c.training.global_batch_size = None, 64
        >>> batch_sizes(c, 4).training, batch_sizes(c, 4).validation
        (16, 16)
    """
    check_batch_keys(config, config.origin)
    t, v, s = config.training, config.validation, config.testing
    accumulation = t.accumulation_steps
    if t.global_batch_size is not None:
        training = _per_rank(config.origin, "training", t.global_batch_size, world_size, accumulation)
    else:
        training = t.batch_size if t.batch_size is not None else DEFAULT_BATCH_SIZE
    validation = _section(
        config.origin, "validation", v.batch_size, v.global_batch_size, world_size, training
    )
    testing = _section(config.origin, "testing", s.batch_size, s.global_batch_size, world_size, validation)
    p = config.predict
    predict = _section(config.origin, "predict", p.batch_size, p.global_batch_size, world_size, validation)
    return BatchSizes(world_size, training, validation, testing, predict)


def _section(
    origin: Origin, section: str, per_rank: int | None, total: int | None, world_size: int, default: int
) -> int:
    if total is not None:
        return _per_rank(origin, section, total, world_size, 1)
    return per_rank if per_rank is not None else default


def _per_rank(origin: Origin, section: str, total: int, world_size: int, accumulation: int) -> int:
    """``total / (world_size x accumulation)``, refused at ``<section>.global_batch_size`` unless whole."""
    unit = world_size * accumulation
    if total % unit == 0:
        return total // unit
    over = f"{world_size} ranks" + (f" x {accumulation} accumulation steps" if accumulation > 1 else "")
    below, above = total // unit * unit, (total // unit + 1) * unit
    multiples = " or ".join(str(m) for m in (below, above) if m > 0)
    worlds = [str(w) for w in range(1, total + 1) if total % (w * accumulation) == 0]
    where = (
        f"or run on {_listed(worlds)} ranks"
        if worlds
        else f"no world size divides it: make it a multiple of {accumulation} (training.accumulation_steps)"
    )
    meaning = GLOBAL_MEANS if section == "training" else f"samples per {_STEP[section]} step across all ranks"
    raise origin.error(
        (section, "global_batch_size"),
        f"{total} ({meaning}) does not divide over {over}: {total / unit:g} per rank and step. Set a "
        f"multiple of {unit} ({multiples}), {where}; or give {section}.batch_size (per rank) instead",
    )


_STEP = {"validation": "evaluation", "testing": "evaluation", "predict": "prediction"}


def _listed(items: list[str], most: int = 8) -> str:
    shown = items[:most]
    if len(items) > most:
        return ", ".join(shown) + " ..."
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def check_batch_keys(config: Config, origin: Origin) -> None:
    """Each section gives ``batch_size`` or ``global_batch_size``, not both (the command line's
    ``--set`` wins over the file, and the other key becomes null); a global size is positive; and
    ``training.lr_scaling`` does not scale by the world size when the global batch is fixed.

    Raises:
        ConfigError: naming the key, its line and the fix.
    """
    for name in SECTIONS:
        section = getattr(config, name)
        per_rank, total = (name, "batch_size"), (name, "global_batch_size")
        if section.global_batch_size is not None and section.global_batch_size <= 0:
            raise origin.error(total, f"must be > 0, got {section.global_batch_size!r}")
        if section.batch_size is None or section.global_batch_size is None:
            continue
        by_hand = origin.from_command_line(per_rank), origin.from_command_line(total)
        if by_hand == (False, True):
            section.batch_size = None  # the command line's global size wins over the file's
        elif by_hand == (True, False):
            section.global_batch_size = None
        else:
            line = origin.line_of(per_rank)
            raise origin.error(
                total,
                f"set together with {name}.batch_size" + (f" (line {line})" if line else "") + ": give one "
                f"of them. {name}.batch_size is per rank and step, whatever the world size; "
                f"{name}.global_batch_size is across all ranks"
                + (f" ({GLOBAL_MEANS})" if name == "training" else "")
                + ", each rank taking its share",
            )
    t = config.training
    if t.global_batch_size is not None and isinstance(t.lr_scaling, str) and t.lr_scaling != "none":
        raise origin.error(
            ("training", "lr_scaling"),
            f"{t.lr_scaling!r} scales the learning rate by the world size, for a per-rank batch_size; with "
            f"training.global_batch_size ({t.global_batch_size}) the batch of an update is the same at every "
            "world size. Leave lr_scaling out, or scale by the global batch over the one the learning rate "
            f"was tuned for: lr_scaling: {{rule: {t.lr_scaling}, reference_batch_size: <that batch>}}",
        )


def asks_world_size(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (``data.build``) has a parameter named ``world_size`` that can be given by
    keyword: then the run passes it its world size.

    Example:
        >>> asks_world_size(lambda seed, world_size: None), asks_world_size(lambda seed, **kw: None)
        (True, False)
    """
    try:
        param = inspect.signature(fn).parameters.get("world_size")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
