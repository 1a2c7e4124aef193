"""A run as one replica group of a torchft job (``parallel.fault_tolerance``), on each rank.

Where the plan holds :class:`~unison.distributed.replica_group.ReplicaSettings`, the build joins
the group (:func:`start_group`, on every rank, after the group's own process group exists) and
changes three parts, the others (evaluation, checkpoint, logging, the user's handlers) unchanged:

- the model is moved to its device but not wrapped in DDP: the trainer wraps it in torchft's DDP
  (:meth:`~unison.distributed.replica_group.ReplicaGroup.wrap_model`), which averages each
  gradient over the group's ranks, then over the groups of the step's quorum;
- the trainer's step is :class:`~unison.engine.quorum_step.QuorumStep` (a step is applied only
  where the quorum commits it), and the model's and optimizer's state are what a healing group
  receives from a live one;
- the training data is cut in ``replica_groups x group size`` shares, the group folded into the
  sampler's rank (:meth:`~unison.distributed.replica_group.ReplicaGroup.data_placement`).

The run's length is counted in the quorum's committed steps: training ends at commit
``max_epochs x epoch_length`` (:func:`stop_at_last_commit`), so a group that was healed from a
peer part-way (its own counters started again) ends with the others, on the same weights.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from unison.distributed import TrainSampler
from unison.distributed.replica_group import ReplicaGroup
from unison.engine import Engine, Events
from unison.engine.quorum_step import QuorumStep, create_replica_trainer
from unison.recipe.planning.batch import batch_options
from unison.recipe.planning.run_plan import RunPlan


def start_group(plan: RunPlan) -> ReplicaGroup | None:
    """This rank's replica group (its torchft Manager), None without ``parallel.fault_tolerance``.

    Distributed:
        Call it on every rank of the group, after the group's process group exists.
    """
    return None if plan.replica is None else ReplicaGroup(plan.replica)


def group_sampler(plan: RunPlan, dataset: Any, group: ReplicaGroup) -> TrainSampler:
    """The training sampler of this rank of ``group``: its share of ``replica_groups`` groups' data."""
    if not isinstance(dataset, Sized) or isinstance(dataset, IterableDataset):
        raise plan.refs.origin.error(
            ("parallel", "fault_tolerance"),
            f"data.build returned a stream ({type(dataset).__name__}) for training, and replica groups cut the "
            "training data into shares by index: return a map-style dataset (with __len__ and __getitem__), or "
            "drop parallel.fault_tolerance",
        )
    t = plan.loaders.training
    rank, world = group.data_placement()
    return TrainSampler(
        dataset, shuffle=t.shuffle, seed=t.seed, drop_last=t.drop_last, rank=rank, world_size=world
    )


def build_group_trainer(plan: RunPlan, group: ReplicaGroup, model: nn.Module, optimizer: Optimizer) -> Engine:
    """The trainer whose every step is one committed step of the group's quorum (the plan's
    clipping, sync points and batch options; accumulation and fp16 are refused at the config)."""
    t, resolved = plan.trainer, plan.resolved
    trainer = create_replica_trainer(
        group,
        model,
        optimizer,
        resolved.loss,
        amp=plan.amp,
        clip_grad_norm=t.clip_grad_norm,
        # Several ranks: a sync point every step, so that the stop at the last commit is applied
        # at that commit in every group (a group's iteration count is its own once it healed).
        sync_every=1 if group.world_size > 1 else t.sync_every,
        **batch_options(resolved.batches, "training"),
    )
    trainer.add_event_handler(Events.COMPLETED, _shut_down, group)
    return trainer


def stop_at_last_commit(plan: RunPlan, trainer: Engine, train_loader: DataLoader | None) -> None:
    """Ends training once the quorum has committed ``max_epochs x epoch_length`` steps.

    Every rank of the group asks at the same iteration (the commit count is the quorum's), and
    the stop is agreed as every stop is: at once with one rank, at the step's sync point with
    several (:func:`build_group_trainer` gives them one each step, whatever
    ``training.sync_every`` says).
    """
    step = trainer._process_function
    if not isinstance(step, QuorumStep) or train_loader is None:
        return
    epoch_length = plan.trainer.epoch_length or len(train_loader)
    last = plan.trainer.max_epochs * epoch_length
    group = step.group

    def _at_last(engine: Engine) -> None:
        if group.step >= last:
            engine.terminate()

    trainer.add_event_handler(Events.ITERATION_COMPLETED, _at_last)


def _shut_down(engine: Engine, group: ReplicaGroup) -> None:
    group.shutdown()
