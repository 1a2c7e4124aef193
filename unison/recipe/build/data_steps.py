"""The data of a run, on each rank: ``data.build``'s datasets, then this rank's loaders."""

from __future__ import annotations

from torch.utils.data import DataLoader, Sampler

from unison.config.batch_sizes import asks_world_size
from unison.distributed import get_world_size, prepare_loaders
from unison.recipe.build.eval_loaders import eval_loader
from unison.recipe.build.parts import Datasets
from unison.recipe.build.stream_data import check_stream_sharding, train_shuffle
from unison.recipe.build.stream_workers import check_stream_workers
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import manual_seed


def build_datasets(plan: RunPlan) -> Datasets:
    """Data, first half: seeds every generator with ``training.seed`` and calls ``data.build``
    (with ``world_size=`` the run's, when it has a parameter of that name).

    Raises:
        TypeError: ``data.build`` returned something other than 2 or 3 datasets.
    """
    seed, resolved = plan.seed, plan.resolved
    manual_seed(seed)
    told = {"world_size": plan.world_size} if asks_world_size(resolved.data_build) else {}
    built = resolved.data_build(seed=seed, **told, **resolved.data_kwargs)
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise TypeError(
            f"data.build must return (train, val) or (train, val, test) datasets, got {type(built).__name__}"
        )
    return Datasets(*built)


def build_loaders(
    plan: RunPlan, datasets: Datasets, train_sampler: Sampler | None = None
) -> tuple[DataLoader | None, DataLoader | None]:
    """Data, second half: this rank's training and validation loaders, as ``plan.loaders`` says.

    The training loader takes the ``training`` section's loader keys (``batch_size``,
    ``num_workers``, ``pin_memory``, ``prefetch_factor``, ``drop_last``, ``shuffle``,
    ``collate``); the validation loader takes the ``validation`` section's, each defaulting to
    the training one (:mod:`unison.recipe.planning.loader_plan`), sharded without padding
    (:func:`unison.recipe.build.eval_loaders.eval_loader`). ``train_sampler``: the training data's
    own (a replica group's share, :mod:`unison.recipe.build.replica_steps`), else by rank.

    Returns:
        ``(train_loader, val_loader)``, each None when its dataset is None.

    Distributed:
        Call it on every rank with the same plan: the samplers shard by rank.
    """
    t = plan.loaders.training
    check_stream_sharding(plan, datasets.train, get_world_size())  # a stream: data.build's, named
    check_stream_workers(plan, datasets.train)  # training.num_workers, named
    train_loader, _ = prepare_loaders(
        datasets.train,
        None,
        batch_size=t.batch_size,
        seed=t.seed,
        shuffle=train_shuffle(plan, datasets.train),  # a stream's source decides its order
        drop_last=t.drop_last,
        collate_fn=t.collate_fn,
        train_sampler=train_sampler,
        **t.worker_kwargs(),
    )
    val_loader = eval_loader(plan.loaders.validation, datasets.val)
    return train_loader, val_loader  # each with its own section's loader keys
