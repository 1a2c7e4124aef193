"""Learning-rate scaling by the global batch, and a linear warmup that composes with any scheduler.

:func:`scale_lr` is the rule (``linear`` or ``sqrt`` in the global batch over the batch the
learning rate was tuned for). :class:`LRWarmup` ramps the learning rate linearly over the
first optimizer updates: update ``k`` (1-based) steps with ``lr * min(1, k / steps)``, where
``lr`` is whatever the optimizer's groups hold at that moment — the scheduler's value.

How warmup and a scheduler compose: the warmup factor is applied inside
``optimizer.step()`` only (a step pre-hook multiplies each group's ``lr``, a post-hook puts
the scheduler's value back). The scheduler therefore never sees the factor: chainable
schedulers (``StepLR``, ``ExponentialLR`` ...) compute each value from the group's
``lr``, and would compound a factor written into it. The learning rate the optimizer
uses at update ``k`` is ``schedule(k) * min(1, k / steps)``, whether the scheduler steps
per update or per epoch, and ``param_groups[i]["lr"]`` (what a checkpoint holds) is the
scheduler's value. The loggers' ``train/lr`` is the rate the update used, factor included
(:mod:`unison.handlers.lr_record`, which the warmup tells once its factor is applied). The
warmup's position is the trainer's ``state.update``, which a checkpoint restores: a resumed
run uses the same learning rates as the uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

from ignite.engine import Engine, Events
from torch.optim import Optimizer

from unison.engine.events import UpdateEvents
from unison.handlers.lr_record import LRRecord
from unison.utils.logging import get_logger

_log = get_logger(__name__)

RULES = ("none", "linear", "sqrt")


def scale_lr(lr: float, rule: str, global_batch: int, reference_batch: int) -> float:
    """The learning rate for ``global_batch`` samples per update, tuned at ``reference_batch``.

    ``linear``: ``lr * global_batch / reference_batch``; ``sqrt``: ``lr * sqrt(global_batch /
    reference_batch)``; ``none``: ``lr``. The global batch is ranks x per-rank batch x
    gradient-accumulation steps.

    Example:
        >>> scale_lr(0.1, "linear", global_batch=256, reference_batch=64)
        0.4
        >>> scale_lr(0.1, "sqrt", global_batch=256, reference_batch=64)
        0.2

    Raises:
        ValueError: an unknown rule, or a batch that is not positive.
    """
    if rule not in RULES:
        raise ValueError(f"scale_lr(rule={rule!r}): expected one of {', '.join(RULES)}.")
    if global_batch < 1 or reference_batch < 1:
        raise ValueError(
            f"scale_lr(global_batch={global_batch}, reference_batch={reference_batch}): both must be >= 1."
        )
    ratio = global_batch / reference_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    return lr


class LRWarmup:
    """Linear learning-rate warmup over the first ``steps`` optimizer updates of a trainer.

    Update ``k`` (1-based, ``trainer.state.update + 1`` when it steps) uses
    ``lr * min(1, k / steps)``: ``lr / steps`` first, the full ``lr`` from update ``steps``
    on. ``lr`` is the value in the optimizer's groups, set by the optimizer or a scheduler;
    the factor lives inside ``optimizer.step()`` only, so it composes with any scheduler
    (see the module's docstring) and a checkpoint holds the scheduler's value.

    Args:
        optimizer: the trainer's optimizer.
        steps: optimizer updates of warmup (0: none).

    Example:
        >>> import torch
        >>> from unison.engine import create_trainer
        >>> from unison.handlers import LRWarmup
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
        >>> trainer = create_trainer(model, optimizer, torch.nn.functional.mse_loss)
        >>> warmup = LRWarmup(optimizer, steps=4)
        >>> warmup.attach(trainer)
        >>> [warmup.lr_at(k) for k in range(1, 6)]
        [0.1, 0.2, 0.30000000000000004, 0.4, 0.4]

    Distributed:
        Attach it on every rank; it issues no collective. Updates happen at the same
        iterations on every rank, so every rank uses the same learning rate.
    """

    def __init__(self, optimizer: Optimizer, steps: int) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"LRWarmup(optimizer=...) needs a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(
                f"LRWarmup(steps={steps!r}): expected an int >= 0 (optimizer updates of warmup)."
            )
        self.optimizer = optimizer
        self.steps = steps
        self._engine: Engine | None = None
        self._kept: list[Any] = []
        self._handles: list[Any] = []

    def factor(self, update: int) -> float:
        """The warmup factor of update ``update`` (1-based)."""
        return 1.0 if update >= self.steps else update / self.steps

    def lr_at(self, update: int) -> list[float] | float:
        """The learning rate update ``update`` (1-based) steps with, at the groups' current ``lr``
        (one number for one group, else one per group)."""
        rates = [group["lr"] * self.factor(update) for group in self.optimizer.param_groups]
        return rates[0] if len(rates) == 1 else rates

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        assert self._engine is not None
        f = self.factor(getattr(self._engine.state, "update", 0) + 1)
        self._kept = [group["lr"] for group in optimizer.param_groups]
        if f != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * f
            LRRecord.note(optimizer)  # the loggers' train/lr: the rate this step uses

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, self._kept, strict=False):  # the scheduler's values back
            group["lr"] = lr
        self._kept = []

    def _on_started(self, engine: Engine) -> None:
        update = getattr(engine.state, "update", 0)
        if 0 < update < self.steps:  # a run resumed inside its warmup says where
            _log.info(
                "lr warmup resumes at update %d of %d (factor %g)",
                update + 1,
                self.steps,
                self.factor(update + 1),
            )

    def attach(self, engine: Engine) -> None:
        """Applies the warmup to ``engine``'s optimizer updates. Attaching twice registers once.

        Raises:
            ValueError: ``engine`` counts no optimizer updates (not a trainer from
                :func:`~unison.engine.create_trainer`), or the warmup is attached to another.
        """
        if UpdateEvents.UPDATE_COMPLETED not in getattr(engine, "_allowed_events", []):
            raise ValueError(
                "LRWarmup.attach(engine): this engine counts no optimizer updates (state.update); attach it to "
                "a trainer from unison.engine.create_trainer."
            )
        if self._engine is not None and self._engine is not engine:
            raise ValueError(
                "LRWarmup.attach: already attached to another engine; make one LRWarmup per trainer."
            )
        if self._engine is None and self.steps > 0:
            self._handles = [
                self.optimizer.register_step_pre_hook(self._before_step),
                self.optimizer.register_step_post_hook(self._after_step),
            ]
        self._engine = engine
        if not engine.has_event_handler(self._on_started, Events.STARTED):
            engine.add_event_handler(Events.STARTED, self._on_started)

    def detach(self) -> None:
        """Removes the warmup from the optimizer and the engine."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._engine is not None and self._engine.has_event_handler(self._on_started, Events.STARTED):
            self._engine.remove_event_handler(self._on_started, Events.STARTED)
        self._engine = None


GROUP_RATES = ("lr", "initial_lr", "max_lr", "min_lr")
"""The learning rates a parameter group holds: its own, and those schedulers keep in it
(``initial_lr`` of every scheduler, ``max_lr`` and ``min_lr`` of ``OneCycleLR``)."""

SCHEDULER_RATES = ("base_lrs", "max_lrs", "_last_lr")
"""The lists of learning rates a scheduler keeps (``max_lrs``: ``CyclicLR``'s peaks)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rebase_lr(optimizer: Optimizer, ratio: float, schedulers: Any = ()) -> None:
    """Multiplies every learning rate the optimizer's groups and ``schedulers`` hold by ``ratio``.

    A schedule then continues from a new base at the point it had reached: each scheduler
    computes from its ``base_lrs`` (and ``initial_lr``) or from the group's ``lr``, and all of
    them move together. A scheduler made of others (``SequentialLR``, ``ChainedScheduler``)
    moves each of them.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> opt.step(); sched.step()
        >>> rebase_lr(opt, 1.5, [sched])
        >>> opt.param_groups[0]["lr"], sched.base_lrs
        (0.15000000000000002, [0.30000000000000004])
    """
    for group in optimizer.param_groups:
        for key in GROUP_RATES:
            if _is_number(group.get(key)):
                group[key] = group[key] * ratio
    todo = [s for s in schedulers if s is not None]
    while todo:
        scheduler = todo.pop()
        todo += list(getattr(scheduler, "_schedulers", []))
        for name in SCHEDULER_RATES:
            rates = getattr(scheduler, name, None)
            if isinstance(rates, list) and all(_is_number(r) for r in rates):
                setattr(scheduler, name, [r * ratio for r in rates])
