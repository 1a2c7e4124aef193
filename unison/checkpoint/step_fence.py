"""What an asynchronous save may copy while training goes on, and the optimizers' steps that wait for it.

The parameters and the state of an optimizer change only in its step. An asynchronous save
leaves their copy to the writer's thread (:meth:`CheckpointWriter.write
<unison.checkpoint.writer.CheckpointWriter.write>`'s ``later``), which takes it while the next
iteration's forward and backward run; a step pre-hook on each optimizer waits for that copy
(:meth:`CheckpointWriter.fence <unison.checkpoint.writer.CheckpointWriter.fence>`) before the
step changes them, and the wait is added to the save's stall.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from unison.checkpoint.writer import CheckpointWriter
from unison.distributed.fsdp import stored_shard

__all__ = ["StepFence"]


class StepFence:
    """The tensors an asynchronous save of ``writer`` copies later, and the hooks that wait for them.

    Args:
        writer: the checkpoint's writer.
        stalls: the checkpoint's stall per save, in seconds: a step's wait is added to the last.
    """

    def __init__(self, writer: CheckpointWriter, stalls: list[float]) -> None:
        self.writer = writer
        self.stalls = stalls
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its step pre-hook's handle

    def later(self, objects: Mapping[str, Any]) -> Callable[[torch.Tensor], bool] | None:
        """Which tensors only an optimizer's step changes: the CPU parameters and state of the
        optimizers among ``objects``, a sharded one's by their local shards (None when there are
        none). Each of these optimizers gets, once, a step pre-hook that waits for the copy."""
        storages: set[int] = set()
        for optimizer in (o for o in objects.values() if isinstance(o, torch.optim.Optimizer)):
            if id(optimizer) not in self._hooks:
                self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(self._before_step)
            tensors = [p for group in optimizer.param_groups for p in group["params"]]
            tensors += [
                v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            ]
            storages.update(key for key in map(_cpu_storage, tensors) if key)
        if not storages:
            return None
        return lambda t: _cpu_storage(t) in storages

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        waited = self.writer.fence()
        if waited and self.stalls:
            self.stalls[-1] += waited


def _cpu_storage(tensor: torch.Tensor) -> int | None:
    """Where a CPU tensor's (or parameter's) memory starts, a DTensor's being its local shard's;
    None for any other tensor (on another device, empty, or another subclass, whose storage is
    not its own)."""
    tensor = stored_shard(tensor)
    if tensor.device.type != "cpu" or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return tensor.untyped_storage().data_ptr() or None
