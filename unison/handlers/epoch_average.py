"""The mean of a per-iteration value over an epoch and over all ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine, Events

_FOLD_AFTER = 1024


class EpochAverage:
    """Averages a scalar the process function returns (the loss) over the epoch, on all ranks.

    Each iteration keeps a reference to the value (no kernel, no host sync, no
    collective); every few thousand iterations the kept values are folded into a sum on
    the device. The sum and count join the engine's sync point at the epoch's end, and the
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
        self._values: list[Any] = []
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._mean = float("nan")

    def reset(self, _: Engine | None = None) -> None:
        self._values.clear()
        self._sum = None
        self._count = 0

    def update(self, engine: Engine) -> None:
        self._values.append(self.output_transform(engine.state.output))
        if len(self._values) >= _FOLD_AFTER:
            self._fold()

    def _fold(self) -> None:
        """Adds the kept values into the device sum, without reading them back."""
        if not self._values:
            return
        values = [v.detach().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in self._values]
        device = values[0].device
        total = torch.stack([v.to(device=device, dtype=torch.float64) for v in values]).sum()
        self._sum = total if self._sum is None else self._sum + total
        self._count += len(values)
        self._values.clear()

    def sync_state(self) -> torch.Tensor:
        self._fold()
        total = torch.zeros((), dtype=torch.float64) if self._sum is None else self._sum.cpu()
        return torch.stack([total, torch.tensor(float(self._count), dtype=torch.float64)])

    def load_synced_state(self, state: torch.Tensor) -> None:
        total, count = state.tolist()
        self._mean = total / count if count else float("nan")

    def _write(self, engine: Engine) -> None:
        engine.state.metrics[self.name] = self._mean

    def attach(self, engine: Engine) -> None:
        """Registers on ``engine`` (a unison Engine); attaching twice has no effect."""
        sync_point = getattr(engine, "sync_point", None)
        if sync_point is None:
            raise TypeError(f"EpochAverage needs unison.engine.Engine, got {type(engine).__name__}.")
        if engine.has_event_handler(self._write, Events.EPOCH_COMPLETED):
            return
        engine.add_event_handler(Events.EPOCH_STARTED, self.reset)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.update)
        sync_point.register(self)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._write)
