"""Samplers that shard a dataset across ranks: padded for training, exact for evaluation."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from unison.distributed.primitives import get_rank, get_world_size


def _check_placement(rank: int | None, world_size: int | None) -> tuple[int, int]:
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}] for world_size={world_size}, got {rank}.")
    return rank, world_size


class TrainSampler(Sampler[int]):
    """Shards a dataset for training: a seeded shuffle per epoch, equal-length shards.

    Every rank draws the same permutation (it depends on ``seed`` and the epoch only) and
    takes every ``world_size``-th index from its rank on, so shards are disjoint. To give
    every rank the same number of samples, the permutation is padded with its own first
    indices (``drop_last=False``) or its tail is dropped (``drop_last=True``).

    The engine calls :meth:`set_epoch` at every epoch start; a loop written by hand must
    call it too, or every epoch repeats the same order.

    Args:
        dataset: anything with ``__len__``.
        shuffle: draw a new permutation each epoch; else keep the dataset's order.
        seed: the base seed, the same on every rank.
        drop_last: drop the tail instead of padding.
        rank: this rank; default, the process group's.
        world_size: the number of shards; default, the process group's.

    Example:
        >>> sampler = TrainSampler(range(10), seed=0, rank=1, world_size=3)
        >>> len(sampler)
        4
        >>> sampler.set_epoch(1)

    Distributed:
        Construct it with the same ``seed`` on every rank.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"TrainSampler needs a dataset with __len__, got {type(dataset).__name__}.")
        self.rank, self.world_size = _check_placement(rank, world_size)
        self.dataset_size = len(dataset)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.dataset_size // self.world_size
        else:
            self.num_samples = math.ceil(self.dataset_size / self.world_size)
        if self.num_samples == 0:
            raise ValueError(
                f"TrainSampler: {self.dataset_size} samples cannot give each of {self.world_size} ranks one "
                f"with drop_last={drop_last}. Use a larger dataset, fewer ranks, or drop_last=False."
            )

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of ``epoch`` (0-based); the engine calls it at each epoch start."""
        self.epoch = int(epoch)

    def _global_order(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=gen).tolist()
        else:
            order = list(range(self.dataset_size))
        total = self.num_samples * self.world_size
        if total <= len(order):
            return order[:total]
        reps = math.ceil(total / len(order))
        return (order * reps)[:total]

    def __iter__(self) -> Iterator[int]:
        return iter(self._global_order()[self.rank :: self.world_size])

    def __len__(self) -> int:
        return self.num_samples


class EvalSampler(Sampler[int]):
    """Shards a dataset for evaluation without padding: every sample exactly once.

    Rank ``r`` takes indices ``r, r + world_size, r + 2 * world_size, ...``. Shards differ in
    length by at most one, and a rank gets none when the dataset has fewer samples than
    there are ranks; unison's evaluator and metrics handle both, so metrics are exact at
    any world size. Order is deterministic: gathered per-rank outputs can be put back in
    dataset order (sample ``i`` is item ``i // world_size`` of rank ``i % world_size``).

    Args:
        dataset: anything with ``__len__``.
        rank: this rank; default, the process group's.
        world_size: the number of shards; default, the process group's.

    Example:
        >>> [list(EvalSampler(range(5), rank=r, world_size=2)) for r in range(2)]
        [[0, 2, 4], [1, 3]]
    """

    def __init__(self, dataset: Sized, *, rank: int | None = None, world_size: int | None = None) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"EvalSampler needs a dataset with __len__, got {type(dataset).__name__}.")
        self.rank, self.world_size = _check_placement(rank, world_size)
        self.dataset_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.world_size))
