"""A stream from ``data.build``: the config keys that meet it, checked where the data is known.

``data.build`` may return a stream (an ``IterableDataset``) for training. A stream is
ordered by its source, gives each rank its share itself, and may not be able to tell where
it stands mid-epoch. :func:`prepare_loaders <unison.distributed.prepare_loaders>` and the
Checkpoint refuse what does not fit in terms of their own arguments; this module refuses
the same in terms of the config, naming the key, its file and line, and the fix:

- :func:`train_shuffle`: ``training.shuffle: true`` written for a stream (left unset, the
  source decides);
- :func:`check_stream_sharding`: a stream that does not split by rank (``data.build``);
- :func:`check_mid_epoch_saves`: ``checkpoint.every_iters``, ``checkpoint.every_seconds`` or
  ``checkpoint.preemption`` with a stream that cannot tell its position;
- :func:`empty_training_data`: the trainer's data yielded no batch on any rank, at the key
  that names the data.

Each runs in the rank, once the data is built, before the trainer starts.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from unison.config import ConfigError
from unison.distributed.data_state import data_position, type_name
from unison.distributed.stream_sources import stream_sharding
from unison.engine.empty_epochs import EmptyDataError
from unison.recipe.planning.run_plan import RunPlan


def _where(plan: RunPlan, *key: str) -> str:
    """``file:line`` (or ``--set ...``) of ``key``, or ``default`` when the config does not write it."""
    origin = plan.refs.origin
    if not origin.given(*key):
        return "default"
    line = origin.line_of(key)
    where = origin.file_of(key) or "<config>"
    return f"{where}:{line}" if line is not None else where


def train_shuffle(plan: RunPlan, train: Any) -> bool | None:
    """What ``prepare_loaders(shuffle=...)`` gets for ``train``: ``training.shuffle`` for a map-style
    dataset; None for a stream (its source orders it).

    Raises:
        ConfigError: ``training.shuffle: true`` is written and ``train`` is a stream.
    """
    shuffle = plan.loaders.training.shuffle
    if not isinstance(train, IterableDataset):
        return shuffle
    if shuffle and plan.refs.origin.given("training", "shuffle"):
        raise plan.refs.origin.error(
            ("training", "shuffle"),
            f"true, but data.build returned a stream ({type_name(train)}) for training, and a stream shuffles "
            "itself: it has no indices to reorder. Remove training.shuffle (the source decides the order), and "
            "shuffle in the source: a seeded shuffle that follows set_epoch(epoch).",
        )
    return None


def check_stream_sharding(plan: RunPlan, train: Any, world_size: int) -> None:
    """Refuses a training stream that every rank would read whole, naming ``data.build``.

    Raises:
        ConfigError: at ``data.build``, with the fix (``unison.distributed.shard_stream``).
    """
    if not isinstance(train, IterableDataset):
        return
    sharding = stream_sharding(train, world_size)
    if not sharding.by_rank:
        raise plan.refs.origin.error(
            ("data", "build"),
            f"returned a training stream, {type(train).__module__}.{type(train).__qualname__}, that does not "
            f"split by rank while {world_size} ranks run, so every rank would train on the same samples. Fix in "
            f"data.build: {sharding.fix}.",
        )


def check_mid_epoch_saves(plan: RunPlan, train_loader: Any) -> None:
    """Refuses mid-epoch checkpoints (``checkpoint.every_iters``, ``checkpoint.every_seconds``,
    ``checkpoint.preemption``) of a training loader that cannot tell where its data stands,
    naming those keys.

    Raises:
        ConfigError: at the first of those keys that is set, with the fix.
    """
    ck = plan.checkpoint
    if ck is None or train_loader is None:
        return
    if ck.every_iters is None and ck.every_seconds is None and not ck.preemption:
        return
    position = data_position(train_loader)
    if position.reports:
        return
    causes = []
    if ck.every_iters is not None:
        causes.append(
            f"checkpoint.every_iters: {ck.every_iters} ({_where(plan, 'checkpoint', 'every_iters')})"
        )
    if ck.every_seconds is not None:
        causes.append(
            f"checkpoint.every_seconds: {ck.every_seconds:g} ({_where(plan, 'checkpoint', 'every_seconds')})"
        )
    if ck.preemption:
        causes.append(f"checkpoint.preemption: true ({_where(plan, 'checkpoint', 'preemption')})")
    settings = (("every_iters", ck.every_iters), ("every_seconds", ck.every_seconds), ("preemption", True))
    key = next(("checkpoint", name) for name, value in settings if value is not None)
    raise plan.refs.origin.error(
        key,
        f"checkpoints are saved inside an epoch ({', '.join(causes)}), and the training data from data.build, a "
        f"{position.source}, cannot tell where it stands: a resume would replay part of the epoch and never "
        "train the rest. Fix: save at epoch ends only (checkpoint.preemption: false, checkpoint.every_iters "
        f"and checkpoint.every_seconds unset, checkpoint.every_epochs for the period), or a source that saves its position ({position.fix}).",
    )


def empty_training_data(plan: RunPlan, err: EmptyDataError) -> ConfigError:
    """The error of a trainer whose data yielded no batch in an epoch on any rank, at the key
    that names the data (``data.stream.files`` with its reader, ``data.build``, ``data.files``)."""
    key, fix = plan.data_key  # planned: the key that names the training data
    return plan.refs.origin.error(key, f"{err} Here: {fix}.")
