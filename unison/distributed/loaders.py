"""DataLoaders sharded across ranks, and splits that agree on every rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset

from unison.distributed.collate import collate
from unison.distributed.primitives import get_rank
from unison.distributed.samplers import EvalSampler, TrainSampler
from unison.distributed.stream_loader import stream_loader
from unison.distributed.worker_start import worker_context


def split_dataset(dataset: Dataset, fractions: Sequence[float], *, seed: int) -> list[Subset]:
    """Splits a dataset into disjoint random subsets that are identical on every rank.

    The permutation depends on ``seed`` alone, never on the rank or on global RNG state, so
    train, validation and test sets agree across ranks and across runs: no sample leaks
    from one to another.

    Args:
        dataset: a map-style dataset with ``__len__``.
        fractions: one fraction per subset, summing to 1; rounding leftovers go to the first.
        seed: the split's seed; pass the same on every rank.

    Example:
        >>> train, val = split_dataset(list(range(10)), [0.8, 0.2], seed=0)
        >>> len(train), len(val)
        (8, 2)
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"split_dataset(seed=...) needs an int, got {type(seed).__name__}: {seed!r}")
    fractions = list(fractions)
    if (
        not fractions
        or not all(isinstance(f, (int, float)) and math.isfinite(f) and f >= 0 for f in fractions)
        or abs(sum(fractions) - 1.0) > 1e-6
    ):
        raise ValueError(
            f"split_dataset(fractions=...) needs non-negative fractions summing to 1, got {fractions}."
        )
    n = len(dataset)  # type: ignore[arg-type]  # a map-style Dataset: sized, though torch's type does not say so
    sizes = [math.floor(f * n + 1e-9) for f in fractions]  # 0.29 * 100 is 28.999...
    sizes[0] += n - sum(sizes)
    gen = torch.Generator()
    gen.manual_seed(seed)
    order = torch.randperm(n, generator=gen).tolist()
    subsets, start = [], 0
    for size in sizes:
        subsets.append(Subset(dataset, order[start : start + size]))
        start += size
    return subsets


def prepare_loaders(
    train: Dataset | None = None,
    val: Dataset | None = None,
    *,
    batch_size: int,
    val_batch_size: int | None = None,
    seed: int = 0,
    shuffle: bool | None = None,
    val_shuffle: bool = False,
    drop_last: bool = False,
    train_sampler: Sampler | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> tuple[DataLoader | None, DataLoader | None]:
    """Builds the training and evaluation DataLoaders of this rank.

    ``batch_size`` is per rank: one optimizer step sees ``batch_size x world_size`` samples.
    The training loader uses a :class:`TrainSampler` (seeded shuffle, ``set_epoch``,
    equal-length shards); the evaluation loader an :class:`EvalSampler` (no padding, each
    sample once), so metrics are exact.

    Args:
        train: the training dataset, or None.
        val: the evaluation dataset, or None.
        batch_size: samples per rank per step.
        val_batch_size: per-rank evaluation batch size; default ``batch_size``.
        seed: the shuffle seed, the same on every rank.
        shuffle: shuffle the training data each epoch; default True for a map-style dataset.
            A stream (an ``IterableDataset``) is ordered by its source: leave it unset.
        val_shuffle: a new evaluation order at each pass, the same on every rank (sums unchanged).
        drop_last: drop the last, incomplete training batch (and the sampler's tail).
        train_sampler: a sampler of your own for the training data; it must shard by rank
            and have ``set_epoch(epoch)``.
        num_workers: worker processes per loader.
        pin_memory: pin host memory for faster copies to the GPU.
        collate_fn: joins a list of items into a batch, for both loaders; default
            :func:`~unison.distributed.collate.collate`: torch's ``default_collate``, or
            torch_geometric's collater when the items are graphs (``Data``/``HeteroData``),
            so a batch of graphs is one ``Batch`` with ``num_graphs`` items.
        **loader_kwargs: passed to both ``DataLoader`` constructors.

    A training stream (an ``IterableDataset``) must give each rank its own share: a
    :func:`~unison.distributed.shard_stream` wrapper, a Hugging Face dataset after
    ``split_dataset_by_node``, a WebDataset with ``split_by_node``; any other is refused
    while several ranks run, and with ``num_workers > 0`` unless it splits by worker too.
    Its loader is torchdata's ``StatefulDataLoader`` when torchdata is installed
    (``unison[stream]``), so a mid-epoch checkpoint can record its position.

    Returns:
        ``(train_loader, val_loader)``, each None when its dataset is None.

    Distributed:
        Call it on every rank with the same arguments.
    """
    for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
        if value is None and name == "val_batch_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"prepare_loaders({name}=...) must be a positive int (per rank), got {value!r}.")
    if isinstance(train, IterableDataset):
        stream = stream_loader(
            train,
            batch_size=batch_size,
            shuffle=shuffle,
            train_sampler=train_sampler,
            drop_last=drop_last,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn or collate,
            **loader_kwargs,
        )
        _, val_loader = prepare_loaders(
            None,
            val,
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            seed=seed,
            val_shuffle=val_shuffle,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            **loader_kwargs,
        )
        return stream, val_loader
    shuffle = True if shuffle is None else shuffle
    if train_sampler is not None and shuffle and not callable(getattr(train_sampler, "set_epoch", None)):
        raise TypeError(
            f"prepare_loaders(train_sampler=...): {type(train_sampler).__name__} has no set_epoch(epoch) "
            "method, so every epoch would repeat the same order. Add set_epoch to it, use "
            "unison.distributed.TrainSampler, or pass shuffle=False if the order is meant to be fixed."
        )
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(
            f"prepare_loaders(collate_fn=...) must be callable (a list of items -> a batch), got "
            f"{type(collate_fn).__name__}: {collate_fn!r}. Leave it unset for torch's default, or torch_geometric's "
            "for graph items."
        )
    common = dict(
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn or collate,
        **worker_context(num_workers, loader_kwargs),
    )
    train_loader = None
    if train is not None:
        sampler = (
            train_sampler
            if train_sampler is not None
            else TrainSampler(cast(Sized, train), shuffle=shuffle, seed=seed, drop_last=drop_last)
        )
        # The loader draws its workers' base seed from this generator, not from torch's
        # global one, so the model's random stream (dropout) does not depend on how many
        # times the data was iterated: a resumed run draws the same numbers. Each rank
        # gets its own stream, so random augmentation differs across ranks.
        loader_gen = common.pop("generator", None) or torch.Generator().manual_seed(
            seed * 1_000_003 + get_rank()
        )
        train_loader = DataLoader(
            train, batch_size=batch_size, sampler=sampler, drop_last=drop_last, generator=loader_gen, **common
        )
    val_loader = None
    if val is not None:
        val_loader = DataLoader(
            val,
            batch_size=val_batch_size or batch_size,
            sampler=EvalSampler(cast(Sized, val), shuffle=val_shuffle, seed=seed),
            **common,
        )
    return train_loader, val_loader
