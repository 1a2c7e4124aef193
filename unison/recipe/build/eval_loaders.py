"""The evaluation loaders of a run: validation and test, each with its section's loader keys.

``validation`` and ``testing`` take the loader keys QuantumGrav's configs give each section
(``batch_size``, ``num_workers``, ``pin_memory``, ``drop_last``, ``prefetch_factor``); the
plan fills in a key a section leaves out from the section before it, once
(:func:`~unison.recipe.planning.loader_plan.loader_plans`). Each rank's shard comes from an
:class:`~unison.distributed.EvalSampler` (no padding, each sample once), so metrics are
exact, unless ``drop_last`` drops each rank's last incomplete batch:
:mod:`unison.recipe.planning.accepted` warns about that once. ``shuffle`` deals a new order at each
evaluation, the same on every rank, from ``training.seed``: every sample is still evaluated
once, so the metrics do not change.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from unison.distributed import prepare_loaders
from unison.distributed.worker_start import worker_context
from unison.recipe.planning.loader_plan import LoaderPlan


def eval_loader(loader: LoaderPlan, dataset: Any) -> DataLoader | None:
    """This rank's loader over ``dataset`` as ``loader`` (a validation or testing
    :class:`~unison.recipe.planning.loader_plan.LoaderPlan`) says, sharded without padding; None without data.

    Distributed:
        Call it on every rank with the same plan: the sampler shards by rank.
    """
    if dataset is None:
        return None
    kwargs = loader.worker_kwargs()
    _, built = prepare_loaders(
        None,
        dataset,
        batch_size=loader.batch_size,
        seed=loader.seed,
        val_shuffle=loader.shuffle,  # a new order each evaluation, the same on every rank
        collate_fn=loader.collate_fn,
        **kwargs,
    )
    if loader.drop_last and built is not None:  # prepare_loaders drops from training loaders only
        built = DataLoader(
            dataset,
            batch_size=loader.batch_size,
            sampler=built.sampler,
            drop_last=True,
            collate_fn=built.collate_fn,  # the one prepare_loaders chose
            **worker_context(kwargs.get("num_workers", 0), kwargs),
        )
    return built
