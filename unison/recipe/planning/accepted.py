"""Keys other trainers' configs carry that unison accepts: what each becomes, in one log line.

QuantumGrav's ``TrainerDDP`` configs name a rank, a DDP output device and evaluator specs
with their own device. unison reads them with their meaning where they have one here
(``parallel.output_device`` on GPUs: :meth:`~unison.recipe.planning.step_plans.ModelPlan.ddp_options`)
and otherwise says, once, that they are not needed (:func:`accepted_lines`, logged by :func:`report_accepted` on rank 0
when a run starts). Evaluation loaders that drop samples get a warning there too.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from unison.config import Config
from unison.distributed import device as rank_device
from unison.distributed import get_rank
from unison.recipe.planning.loader_plan import LoaderPlans
from unison.utils import get_logger

_log = get_logger("unison.recipe.run")  # the run's logger


def compile_options(config: Config) -> dict[str, Any] | None:
    """``training.compile`` as ``torch.compile`` options: None when off, ``{}`` for true.

    Example:
        >>> from unison.config import Config
        >>> c = Config()
        >>> compile_options(c), (setattr(c.training, "compile", True), compile_options(c))[1]
        (None, {})
    """
    spec = config.training.compile
    if spec is False:
        return None
    if spec is True:
        return {}
    return {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}


USED_EVALUATOR_KEYS = ("criterion", "apply_model")
"""Keys of QuantumGrav's ``validator``/``tester`` that unison uses: the section's loss and model call."""


@dataclass(frozen=True)
class AcceptedKeys:
    """The accepted keys of a config that :func:`accepted_lines` speaks of, read once by the plan.

    Attributes:
        rank: ``parallel.rank``.
        output_device: ``parallel.output_device``.
        evaluator_specs: ``(section, key, spec)`` of ``validation.validator`` and ``testing.tester``.
        dropping: ``(section, batch size)`` of each evaluation section with ``drop_last``.
    """

    rank: int | None
    output_device: int | str | None
    evaluator_specs: tuple[tuple[str, str, dict[str, Any]], ...]
    dropping: tuple[tuple[str, int], ...]


def accepted_keys(config: Config, loaders: LoaderPlans) -> AcceptedKeys:
    """``config``'s :class:`AcceptedKeys`; ``loaders`` gives each evaluation section's batch size."""
    p = config.parallel
    specs = tuple(
        (section, key, dict(getattr(getattr(config, section), key)))
        for section, key in (("validation", "validator"), ("testing", "tester"))
    )
    dropping = tuple(
        (plan.section, plan.batch_size) for plan in (loaders.validation, loaders.testing) if plan.drop_last
    )
    return AcceptedKeys(p.rank, p.output_device, specs, dropping)


def _evaluator_lines(
    section: str, key: str, spec: dict[str, Any], device: torch.device
) -> list[tuple[int, str]]:
    """What becomes of each key of ``validation.validator`` / ``testing.tester`` (QuantumGrav's)."""
    lines: list[tuple[int, str]] = []
    what = "validation set" if section == "validation" else "test set"
    idle = {k: v for k, v in spec.items() if k in ("device", "type")}
    if idle:
        given = ", ".join(f"{k}={v}" for k, v in idle.items())
        lines.append(
            (
                logging.INFO,
                f"{section}.{key} ({given}) is not needed: every rank evaluates its shard of the {what} on its "
                f"own device ({device.type} here) and the metrics are exact over all ranks",
            )
        )
    if "evaluator_tasks" in spec:
        lines.append(
            (
                logging.WARNING,
                f"{section}.{key}.evaluator_tasks are not run: their monitors see every prediction at once, "
                f"which no rank holds here. Name metrics in {section if section == 'validation' else 'validation'}"
                ".metrics instead (an ignite metric such as ignite.metrics.Fbeta is summed over ranks exactly)",
            )
        )
    for name in sorted(set(spec) - {"device", "type", "evaluator_tasks", *USED_EVALUATOR_KEYS}):
        lines.append(
            (logging.WARNING, f"{section}.{key}.{name} is not used by unison: it has no effect here")
        )
    return lines


def accepted_lines(keys: AcceptedKeys, device: torch.device | None = None) -> list[tuple[int, str]]:
    """(level, message) for each accepted key that is not used on ``device`` (default this rank's),
    and each evaluation loader that drops samples."""
    device = device if device is not None else rank_device()
    lines: list[tuple[int, str]] = []
    p = keys
    if p.rank is not None:
        lines.append(
            (
                logging.INFO,
                f"parallel.rank {p.rank} is not used: each process takes its rank from the launcher "
                "(unison run --nproc, torchrun, srun)",
            )
        )
    if p.output_device is not None and device.type != "cuda":
        lines.append(
            (
                logging.INFO,
                f"parallel.output_device {p.output_device!r} is not used: the ranks run on the {device.type}, "
                "where DDP returns the output on the model's device",
            )
        )
    for section, key, spec in keys.evaluator_specs:
        lines += _evaluator_lines(section, key, spec, device)
    for section, batch in keys.dropping:
        lines.append(
            (
                logging.WARNING,
                f"{section}.drop_last is true: each rank drops its last incomplete batch, so the {section} "
                f"metrics skip up to {batch - 1} samples per rank and change with the world size; set it "
                "false for exact metrics",
            )
        )
    return lines


def report_accepted(keys: AcceptedKeys) -> None:
    """Rank 0 logs :func:`accepted_lines` of the plan's ``keys`` (``plan.accepted``), once per run.

    Distributed:
        Call it on every rank; only rank 0 writes.
    """
    if get_rank() != 0:
        return
    for level, message in accepted_lines(keys):
        _log.log(level, message)
