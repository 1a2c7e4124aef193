"""The evaluation loaders of a run: validation and test, each with its section's loader keys.

``validation`` and ``testing`` take the loader keys QuantumGrav's configs give each section
(``batch_size``, ``num_workers``, ``pin_memory``, ``drop_last``, ``prefetch_factor``). A key
left out falls back to the section before it: testing to validation, validation to
training (``batch_size``, ``pin_memory``, ``prefetch_factor``; workers default to 0 for
validation). Each rank's shard comes from an :class:`~unison.distributed.EvalSampler`
(no padding, each sample once), so metrics are exact, unless ``drop_last`` drops each
rank's last incomplete batch: :mod:`unison.recipe.accepted` warns about that once.
``shuffle`` deals a new order at each evaluation, the same on every rank, from
``training.seed``: every sample is still evaluated once, so the metrics do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch.utils.data import DataLoader

from unison.config import Config
from unison.distributed import prepare_loaders

Section = Literal["validation", "testing"]


def eval_batch_size(config: Config, section: Section) -> int:
    """The per-rank batch size of ``section``: its own, else validation's, else training's."""
    t, v = config.training, config.validation
    if section == "testing" and config.testing.batch_size is not None:
        return config.testing.batch_size
    return v.batch_size or t.batch_size


def eval_loader_kwargs(config: Config, section: Section) -> dict[str, Any]:
    """The DataLoader keys of ``section``: ``num_workers``, ``pin_memory``, ``drop_last`` and, with
    workers, ``prefetch_factor``; a key the section leaves out comes from the section before it.

    Example:
        >>> from unison.config import Config
        >>> c = Config()
        >>> c.training.pin_memory, c.validation.num_workers, c.testing.drop_last = True, 2, True
        >>> eval_loader_kwargs(c, "testing")
        {'num_workers': 2, 'pin_memory': True, 'drop_last': True}
    """
    t, v, s = config.training, config.validation, config.testing
    workers = v.num_workers
    pin = t.pin_memory if v.pin_memory is None else v.pin_memory
    prefetch = t.prefetch_factor if v.prefetch_factor is None else v.prefetch_factor
    drop_last = v.drop_last
    if section == "testing":
        workers = workers if s.num_workers is None else s.num_workers
        pin = pin if s.pin_memory is None else s.pin_memory
        prefetch = prefetch if s.prefetch_factor is None else s.prefetch_factor
        drop_last = s.drop_last
    kwargs: dict[str, Any] = {"num_workers": workers, "pin_memory": pin, "drop_last": drop_last}
    if prefetch is not None and workers > 0:  # a DataLoader without workers refuses prefetch_factor
        kwargs["prefetch_factor"] = prefetch
    return kwargs


def eval_loader(
    config: Config, section: Section, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None
) -> DataLoader | None:
    """This rank's loader over ``dataset`` for ``section``, sharded without padding; None without data.
    ``collate_fn`` joins items into batches (default: :func:`~unison.distributed.collate`).

    Distributed:
        Call it on every rank with the same config: the sampler shards by rank.
    """
    if dataset is None:
        return None
    kwargs = eval_loader_kwargs(config, section)
    drop_last = kwargs.pop("drop_last")
    batch_size = eval_batch_size(config, section)
    shuffle = getattr(config, section).shuffle  # a new order each evaluation, the same on every rank
    _, loader = prepare_loaders(
        None,
        dataset,
        batch_size=batch_size,
        seed=config.training.seed,
        val_shuffle=shuffle,
        collate_fn=collate_fn,
        **kwargs,
    )
    if drop_last and loader is not None:  # prepare_loaders drops from training loaders only
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=loader.sampler,
            drop_last=True,
            collate_fn=loader.collate_fn,  # the one prepare_loaders chose
            **kwargs,
        )
    return loader
