"""The learning rates an optimizer's last update used: what the loggers write as ``train/lr``.

What ``param_groups`` hold when a logger's handler runs is not always what the last update
used. :class:`~unison.handlers.lr_scaling.LRWarmup` applies its factor inside
``optimizer.step()`` only, so the groups show the un-warmed value between steps; and a
scheduler that steps at ``EPOCH_COMPLETED`` before the logger's handler has already moved
the groups to the next epoch's value. :class:`LRRecord` keeps each group's ``lr`` as every
step starts (a step pre-hook), and the warmup records again once its factor is applied, so
the order in which the two hooks were registered does not matter.

:func:`used_rates` is the one rule both loggers follow: the rates of the last update, or the
groups' current ones before any update was recorded (a run that has not stepped yet, an
optimizer no logger asked about before).

Cost: one list of the groups' learning rates per optimizer step, taken only for an optimizer
a logger asked about (:meth:`LRRecord.of`). A learning rate is a Python float; a tensor one is
copied on its device (schedulers update those in place), never read on the host there.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim import Optimizer

_RECORDS: weakref.WeakKeyDictionary[Optimizer, LRRecord] = weakref.WeakKeyDictionary()


def _held(lr: Any) -> Any:
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


class LRRecord:
    """The learning rate of each parameter group at the optimizer's last step.

    Made by :meth:`of`, one per optimizer however many loggers ask. It holds no reference
    to the optimizer (the optimizer holds it, through its hook).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> record = LRRecord.of(opt)
        >>> opt.step(); opt.param_groups[0]["lr"] = 0.05
        >>> record.used, used_rates(opt)
        ([0.1], {'train/lr': 0.1})
    """

    def __init__(self) -> None:
        self.used: list[Any] | None = None
        """Each group's ``lr`` at the last step; None before one was recorded."""

    @classmethod
    def of(cls, optimizer: Optimizer) -> LRRecord:
        """The optimizer's record; the first call registers its step pre-hook."""
        record = _RECORDS.get(optimizer)
        if record is None:
            record = _RECORDS[optimizer] = cls()
            optimizer.register_step_pre_hook(record._before_step)
        return record

    @staticmethod
    def note(optimizer: Optimizer) -> None:
        """Records the groups' ``lr`` now, when a logger asked for the optimizer's record:
        called by whatever changes the rate inside a step, once it has changed it."""
        record = _RECORDS.get(optimizer)
        if record is not None:
            record.keep(optimizer)

    def keep(self, optimizer: Optimizer) -> None:
        """Records the groups' ``lr`` as they are now."""
        self.used = [_held(group.get("lr")) for group in optimizer.param_groups]

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.keep(optimizer)


def used_rates(
    optimizer: Optimizer, *, device_ok: bool = False, prefix: str = "train/lr"
) -> dict[str, float]:
    """``prefix`` (one group) or ``prefix/<i>`` (each group) -> the learning rate of the
    optimizer's last recorded update; the groups' current ``lr`` before one.

    A tensor on a device other than the CPU is read only when ``device_ok`` (at a point where
    the device has been waited for); otherwise it is left out.
    """
    record = _RECORDS.get(optimizer)
    groups = optimizer.param_groups
    rates = record.used if record is not None and record.used is not None else None
    if rates is None or len(rates) != len(groups):  # no update yet, or groups added since
        rates = [group.get("lr") for group in groups]
    out: dict[str, float] = {}
    for i, lr in enumerate(rates):
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" and not device_ok:
                continue
            lr = float(lr)
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            out[prefix if len(rates) == 1 else f"{prefix}/{i}"] = float(lr)
    return out
