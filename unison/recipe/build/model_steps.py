"""The model of a run, on each rank: the model wrapped for the world size, its optimizer and
scheduler (the learning rate scaled), and the trainer that steps them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unison.distributed import device, prepare_model
from unison.engine import Engine, create_trainer
from unison.recipe.planning.batch import batch_options
from unison.recipe.planning.lr_plan import scaled_optimizer_kwargs, scaled_scheduler_kwargs
from unison.recipe.planning.run_plan import RunPlan


def build_model(plan: RunPlan) -> nn.Module:
    """Model: builds ``model.type(*model.args, **model.kwargs)``, moves it to this rank's device and
    wraps it as ``plan.model`` says; a replica group's is only moved (its trainer wraps it in
    torchft's DDP, :mod:`unison.recipe.build.replica_steps`).

    Distributed:
        Call it on every rank: wrapping in DDP or sharding broadcasts rank 0's parameters.
    """
    resolved, m = plan.resolved, plan.model
    model = resolved.model_type(*resolved.model_args, **resolved.model_kwargs)
    if plan.replica is not None:
        return model.to(device())
    return prepare_model(
        model,
        strategy=m.strategy,
        fsdp=m.fsdp,
        compile=m.compile,
        activation_checkpointing=m.activation_checkpointing,
        sync_batchnorm=m.sync_batchnorm,
        find_unused_parameters=m.find_unused_parameters,
        **m.ddp_options(),  # parallel.output_device, on GPUs
    )


def build_optimizer(plan: RunPlan, model: nn.Module, world_size: int) -> tuple[torch.optim.Optimizer, Any]:
    """Optimizer and scheduler: ``training.lr`` overrides the optimizer's ``lr`` (in the plan), then scaled.

    The learning rate is scaled by ``training.lr_scaling`` in the global batch of
    ``world_size`` ranks (see :mod:`unison.recipe.planning.lr_plan`).

    Returns:
        ``(optimizer, scheduler)``; the scheduler is None without ``training.scheduler_type``.
    """
    resolved, lr = plan.resolved, plan.lr.at(world_size)
    opt_kwargs = scaled_optimizer_kwargs(
        lr, resolved.optimizer_type, plan.optimizer_kwargs, resolved.optimizer_args
    )
    optimizer = resolved.optimizer_type(model.parameters(), *resolved.optimizer_args, **opt_kwargs)
    scheduler_kwargs = scaled_scheduler_kwargs(lr, resolved.scheduler_type, resolved.scheduler_kwargs)
    scheduler = resolved.scheduler_type(optimizer, **scheduler_kwargs) if resolved.scheduler_type else None
    return optimizer, scheduler


def build_trainer(plan: RunPlan, model: nn.Module, optimizer: torch.optim.Optimizer) -> Engine:
    """Trainer: the training engine, with the ``training`` section's amp, accumulation and clipping."""
    t, resolved = plan.trainer, plan.resolved
    return create_trainer(
        model,
        optimizer,
        resolved.loss,
        amp=plan.amp,
        accumulation_steps=t.accumulation_steps,
        clip_grad_norm=t.clip_grad_norm,
        sync_every=t.sync_every,
        **batch_options(resolved.batches, "training"),  # training.batch, model.call
    )
