"""Samplers that shard a dataset across ranks: padded for training, exact for evaluation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import DistributedSampler, Sampler

from unison.distributed.primitives import get_rank, get_world_size


def _check_placement(rank: int | None, world_size: int | None) -> tuple[int, int]:
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}] for world_size={world_size}, got {rank}.")
    return rank, world_size


def samplers_with_set_epoch(data: Any) -> list[Any]:
    """The distinct objects behind ``data`` that have a ``set_epoch`` method.

    Looks at a DataLoader's batch sampler, the sampler inside that batch sampler, and its
    sampler, in that order; a custom batch sampler that shuffles (bucketing, say) is found
    as well as the usual ``DataLoader(sampler=...)``.
    """
    found: list[Any] = []
    batch_sampler = getattr(data, "batch_sampler", None)
    for candidate in (batch_sampler, getattr(batch_sampler, "sampler", None), getattr(data, "sampler", None)):
        if candidate is not None and callable(getattr(candidate, "set_epoch", None)):
            if not any(candidate is f for f in found):
                found.append(candidate)
    return found


def set_sampler_epoch(data: Any, epoch: int) -> None:
    """Calls ``set_epoch(epoch)`` on every sampler behind ``data`` (see :func:`samplers_with_set_epoch`).

    unison's Engine does this at every epoch start, with the 0-based epoch; call it at
    ``EPOCH_STARTED`` in a loop of your own (or on ignite's Engine), or every epoch
    repeats the same order.

    Example:
        >>> sampler = TrainSampler(range(8), seed=0, rank=0, world_size=2)
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(8), batch_size=2, sampler=sampler)
        >>> set_sampler_epoch(loader, 3)
        >>> sampler.epoch
        3
    """
    for sampler in samplers_with_set_epoch(data):
        sampler.set_epoch(epoch)


class TrainSampler(DistributedSampler[int]):
    """Shards a dataset for training: torch's ``DistributedSampler``, resumable mid-epoch.

    It is a ``DistributedSampler`` (tools that look for one recognise it, and its order is
    torch's, bit for bit) that adds a position: after :meth:`load_state_dict` the saved
    epoch skips the samples already trained on, without loading them. Every rank draws the same permutation (it depends on ``seed`` and the epoch only) and
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
        rank, world_size = _check_placement(rank, world_size)
        size = len(dataset)
        if (size // world_size if drop_last else math.ceil(size / world_size)) == 0:
            fix = "Use a larger dataset or fewer ranks" + (", or drop_last=False." if drop_last else ".")
            raise ValueError(
                f"TrainSampler: {size} samples cannot give each of {world_size} ranks one "
                f"with drop_last={drop_last}. {fix}"
            )
        # torch's sampler draws the order and shards it; this class adds the resume offset.
        super().__init__(
            dataset,  # type: ignore[arg-type]  # any Sized will do: torch only takes its len()
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=int(seed),
            drop_last=drop_last,
        )
        self.dataset_size = size
        self._resume: tuple[int, int] | None = None  # (epoch, samples of the shard to skip)

    @property
    def world_size(self) -> int:
        """The number of shards (torch's ``num_replicas``)."""
        return self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of ``epoch`` (0-based); the engine calls it at each epoch start."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None

    @property
    def start(self) -> int:
        """How many samples of this rank's shard the current epoch skips (after a resume)."""
        return self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0

    def state_dict(self, consumed: int = 0) -> dict[str, int | bool]:
        """The sampler's position: epoch, and ``consumed`` samples of this rank's shard.

        The sampler cannot count what it handed out itself (a DataLoader with workers
        reads ahead); the caller (unison's Checkpoint) passes the samples the engine
        actually trained on.
        """
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": int(consumed),
            "dataset_size": self.dataset_size,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resumes at a saved position: the saved epoch then skips the samples already seen.

        Skipped samples are never loaded: they are left out of the index list. Resuming
        mid-epoch needs the same world size and dataset; at an epoch boundary the world
        size may change.
        """
        if int(state["dataset_size"]) != self.dataset_size:
            raise ValueError(
                f"TrainSampler.load_state_dict: the checkpoint was taken on a dataset of {state['dataset_size']} "
                f"samples, this one has {self.dataset_size}. Resume with the same dataset."
            )
        consumed = int(state["consumed"])
        if consumed and int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"TrainSampler.load_state_dict: the checkpoint was taken mid-epoch with world size "
                f"{state['world_size']}, this run has {self.world_size}. A mid-epoch position belongs to one "
                "sharding; resume with the same world size, or from a checkpoint taken at an epoch's end."
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, consumed) if consumed else None

    def __iter__(self) -> Iterator[int]:
        shard = super().__iter__()
        if self.start:
            return itertools.islice(shard, self.start, None)  # skipped samples are never loaded
        return shard

    def __len__(self) -> int:
        return self.num_samples - self.start


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
