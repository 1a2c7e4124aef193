"""The mean of a per-iteration value over an epoch and over all ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine, Events

from unison.distributed.sync import require_sync_point


class EpochAverage:
    """Averages a scalar the process function returns (the loss) over the epoch, on all ranks.

    Each iteration adds the value into a float64 sum on its device: one small kernel, no
    host sync, no collective. The sum and count join the engine's sync point at the epoch's end, and the
    mean over every iteration of every rank is written to ``engine.state.metrics[name]``.

    Args:
        name: the key in ``engine.state.metrics``.
        output_transform: picks the scalar from ``engine.state.output``.

    Example:
        >>> from unison.engine import Engine
        >>> engine = Engine(lambda e, b: torch.tensor(float(b)))
        >>> EpochAverage("value").attach(engine)
        >>> engine.run([1, 2, 3]).metrics["value"]
        2.0

    Distributed:
        Attach it on every rank of a unison :class:`~unison.engine.Engine`: its sync is part
        of the engine's sync point.
    """

    def __init__(self, name: str = "loss", output_transform: Callable[[Any], Any] = lambda x: x) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"EpochAverage(name={name!r}) must be a non-empty string.")
        self.name = name
        self.output_transform = output_transform
        self._sum: torch.Tensor | None = None
        self._scalar = False
        self._plain = 0.0
        self._count = 0
        self._mean = float("nan")

    def reset(self, _: Engine | None = None) -> None:
        self._sum = None
        self._plain = 0.0
        self._count = 0

    def update(self, engine: Engine) -> None:
        self.add(self.output_transform(engine.state.output))

    def add(self, value: torch.Tensor | float) -> None:
        """Adds one iteration's value: what :meth:`update` does with the engine's output, for a
        step that adds its own (``attach(engine, per_iteration=False)``)."""
        if value.__class__ is torch.Tensor and self._sum is not None and self._scalar:
            self._sum.add_(value.detach())  # the common case: one in-place add
        elif isinstance(value, torch.Tensor):
            # One in-place add on the value's device: nothing is read back, no graph or
            # buffer is kept alive, and a step that reuses its output tensor is counted right.
            value = value.detach()
            if self._sum is None:
                self._scalar = value.dim() == 0
                self._sum = value.reshape(()).to(torch.float64, copy=True)
            else:
                self._sum.add_(value.reshape(()))
        else:
            self._plain += float(value)
        self._count += 1

    def sync_state(self) -> torch.Tensor:
        total = self._plain + (0.0 if self._sum is None else float(self._sum.item()))
        return torch.tensor([total, float(self._count)], dtype=torch.float64)

    def load_synced_state(self, state: torch.Tensor) -> None:
        total, count = state.tolist()
        self._mean = total / count if count else float("nan")

    def restore_partial(self, values: list[float]) -> None:
        """Starts the epoch from saved sums ``[total, count]`` (a mid-epoch resume)."""
        total, count = values
        self._sum = None
        self._plain = float(total)
        self._count = int(count)

    def _write(self, engine: Engine) -> None:
        engine.state.metrics[self.name] = self._mean

    def attach(self, engine: Engine, per_iteration: bool = True) -> None:
        """Registers on ``engine`` (a unison Engine); attaching twice has no effect.

        ``per_iteration=False`` leaves out the ``ITERATION_COMPLETED`` handler: the process
        function then calls :meth:`add` with each iteration's value.
        """
        sync_point = require_sync_point(engine, "EpochAverage").sync_point
        if engine.has_event_handler(self._write, Events.EPOCH_COMPLETED):
            return
        engine.add_event_handler(Events.EPOCH_STARTED, self.reset)
        if per_iteration:
            engine.add_event_handler(Events.ITERATION_COMPLETED, self.update)
        sync_point.register(self)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._write)
