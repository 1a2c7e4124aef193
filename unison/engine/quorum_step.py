"""The training step inside a torchft quorum: a step is applied only where the quorum commits it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine as IgniteEngine
from torch import nn
from torch.optim import Optimizer

from unison.distributed.batches import move_to_device
from unison.distributed.fsdp import global_value as _global
from unison.distributed.replica_group import ReplicaGroup
from unison.engine.engine import Engine
from unison.engine.steps import TrainStep, create_trainer


class QuorumStep:
    """One committed step of a replica group, as the trainer's process function.

    Each try joins the step's quorum (a group behind it is healed from a live peer first),
    runs forward and backward (the gradient is averaged over the quorum's groups by the
    model's torchft DDP), and asks every rank of the group whether to commit. A committed
    step runs the optimizer; a step that is not committed (a peer group died during the
    all-reduce, too few groups) is tried again on the same batch in the next quorum, up to
    ``step_attempts`` times, then the rank fails. So the engine's counters follow committed
    steps only, and no batch of a live group is skipped.
    """

    def __init__(self, inner: TrainStep, group: ReplicaGroup) -> None:
        self.inner = inner
        self.group = group
        self.attempts = group.settings.step_attempts
        self.failed_tries = 0
        """Tries that were not committed, over the run (each one a batch tried again)."""
        self.model = inner.model
        self.optimizer = inner.optimizer

    def __getattr__(self, name: str) -> Any:
        """What handlers read of the trainer's step (``scaler``, ``loss_average``, ``grad_norm``...):
        the inner :class:`~unison.engine.steps.TrainStep`'s."""
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def at_boundary(self, engine: IgniteEngine) -> bool:
        return True  # every step is a whole update

    def _try(self, engine: IgniteEngine, batch: Any) -> tuple[torch.Tensor, bool]:
        step = self.inner
        self.group.start_step()
        step.optimizer.zero_grad(set_to_none=True)
        if step._takes_batch:  # the criterion reads the whole batch (BatchLoss), as in TrainStep
            batch = move_to_device(batch, step.device, step.non_blocking)
            x, _ = step.prepare_batch(batch, step.device, step.non_blocking)
            y = batch
        else:
            x, y = step.prepare_batch(batch, step.device, step.non_blocking)
        loss = step._forward_backward(x, y, 1, engine)
        if not self.group.commit():
            return loss, False
        if step.clip_grad_norm is not None:
            step.grad_norm = _global(
                nn.utils.clip_grad_norm_(step.model.parameters(), step.clip_grad_norm).detach()
            )
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
        return loss, True

    def __call__(self, engine: IgniteEngine, batch: Any) -> torch.Tensor:
        for _ in range(self.attempts):
            loss, committed = self._try(engine, batch)
            if committed:
                break
            self.failed_tries += 1
        else:
            raise RuntimeError(
                f"replica group {self.group.settings.replica_id}: the step at commit {self.group.step} was not "
                f"committed in {self.attempts} tries (no quorum of min_replicas={self.group.settings.min_replicas} "
                "groups, or a cross-group all-reduce failing each time); check that the other groups and the "
                "lighthouse are up, or raise parallel.fault_tolerance.step_attempts."
            )
        self.inner._updated(engine)
        loss = loss.detach()
        if self.inner.loss_average is not None:
            self.inner.loss_average.add(loss)
        return loss


def create_replica_trainer(
    group: ReplicaGroup,
    model: nn.Module,
    optimizer: Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    **kwargs: Any,
) -> Engine:
    """A trainer whose every step is one committed step of a torchft quorum.

    ``model`` is the plain module: it is wrapped here in torchft's DDP (see
    :meth:`~unison.distributed.replica_group.ReplicaGroup.wrap_model`), and the model's and the
    optimizer's state are tracked for healing peers. The other arguments are those of
    :func:`~unison.engine.create_trainer`, less ``amp='fp16'`` (a loss scaler skipping steps on
    its own would let groups diverge) and ``accumulation_steps`` (one batch per committed step).
    The wrapped model is ``trainer.process_function.model``.
    """
    for refused in ("accumulation_steps", "scaler"):
        if kwargs.get(refused) not in (None, 1):
            raise ValueError(
                f"create_replica_trainer({refused}={kwargs[refused]!r}): a replica group commits one batch per "
                f"step; drop {refused} (raise the batch size instead of accumulating)."
            )
    if kwargs.get("amp") == "fp16":
        raise ValueError(
            "create_replica_trainer(amp='fp16'): the loss scaler skips steps on its own, which replica groups "
            "would not agree on; use amp='bf16' or full precision."
        )
    group.track_training(model, optimizer)
    wrapped = group.wrap_model(model)
    trainer = create_trainer(wrapped, optimizer, loss_fn, **kwargs)
    inner = trainer.process_function
    assert isinstance(inner, TrainStep)
    trainer._process_function = QuorumStep(inner, group)
    return trainer
