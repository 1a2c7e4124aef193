"""Samplers that shard a dataset across ranks: padded for training, exact for evaluation."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any, NamedTuple

import torch
from torch.utils.data import DistributedSampler, IterableDataset, Sampler

from unison.distributed.primitives import get_rank, get_world_size
from unison.distributed.sampler_order import advance_position, epoch_order, layout_order, remaining_positions


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
    """Calls ``set_epoch(epoch)`` on every sampler behind ``data`` (see :func:`samplers_with_set_epoch`),
    and on its dataset when that is a stream (an ``IterableDataset``) with ``set_epoch``.

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
    stream = getattr(data, "dataset", None)  # a stream orders itself (shard_stream, a shuffle buffer)
    set_stream_epoch = getattr(stream, "set_epoch", None) if isinstance(stream, IterableDataset) else None
    if callable(set_stream_epoch):
        set_stream_epoch(epoch)


class _Resume(NamedTuple):
    """A loaded position: the epoch, the samples of this rank's shard to skip, and where its layout starts."""

    epoch: int
    skip: int
    consumed: int = 0
    extra: tuple[int, ...] = ()

    @property
    def resharded(self) -> bool:
        return bool(self.consumed or self.extra)


class TrainSampler(DistributedSampler[int]):
    """Shards a dataset for training: torch's ``DistributedSampler``, resumable mid-epoch.

    It is a ``DistributedSampler`` (tools that look for one recognise it, and its order is
    torch's, bit for bit) that adds a position: after :meth:`load_state_dict` the saved
    epoch skips the samples already trained on, without loading them. Every rank draws the same permutation (it depends on ``seed`` and the epoch only) and
    takes every ``world_size``-th index from its rank on, so shards are disjoint. To give
    every rank the same number of samples, the permutation is padded with its own first
    indices (``drop_last=False``) or its tail is dropped (``drop_last=True``).

    **Another world size mid-epoch**: a position saved at ``N`` ranks and loaded at ``M != N``
    (or with another ``drop_last``) continues the saved epoch's permutation from its first
    sample not yet consumed. The samples still to go, in permutation order, are sharded over
    the ``M`` ranks by the same rule: padded with their own first samples, or their tail
    dropped with ``drop_last``. Over the whole epoch no sample is seen twice but for that
    padding, and none is left out but for that dropped tail (at ``N`` ranks with
    ``drop_last``, the tail the stopped run would have dropped is among the samples to go).

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
        self._resume: _Resume | None = None
        self._loaded: _Resume | None = None  # the last loaded position, kept past set_epoch for state_dict
        self._handed_out = (-1, 0)  # (epoch, samples) of the last iterator: state_dict() without consumed

    @property
    def world_size(self) -> int:
        """The number of shards (torch's ``num_replicas``)."""
        return self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of ``epoch`` (0-based); the engine calls it at each epoch start."""
        self.epoch = int(epoch)
        if self._resume is not None and self._resume.epoch != self.epoch:
            self._resume = None

    @property
    def start(self) -> int:
        """How many samples of this rank's shard the current epoch skips (after a resume)."""
        resume = self._current()
        return resume.skip if resume is not None else 0

    def _current(self) -> _Resume | None:
        return self._resume if self._resume is not None and self._resume.epoch == self.epoch else None

    def state_dict(
        self,
        consumed: int | None = None,
        *,
        consumed_by_rank: Sequence[int] | None = None,
        epoch: int | None = None,
    ) -> dict[str, Any]:
        """The sampler's position: epoch, ``consumed`` samples of this rank's shard, and the global position.

        Without ``consumed``, the samples this epoch's iterator handed out (skipped ones
        included): what a loader that draws indices only for the batches it yields reports,
        as torchdata's ``StatefulDataLoader`` does (``state_dict()`` without arguments, then
        ``load_state_dict``). A DataLoader with workers reads ahead of training, so unison's
        Checkpoint passes the samples the engine actually trained on.

        Args:
            consumed: samples of this rank's shard trained on (skipped ones included); None
                for the samples handed out.
            consumed_by_rank: every rank's ``consumed``, when they differ; else all equal it.
            epoch: the epoch of the data iterator described, when it is not the current one.

        Returns:
            The sharding (``seed``, ``epoch``, ``dataset_size``, ``world_size``, ``shuffle``,
            ``drop_last``), this rank's ``consumed``, where the shards start in the epoch's
            order (``layout_consumed``, ``layout_extra``: 0 and ``[]`` but after a resume at
            another world size) and the global position: positions ``0 ..
            global_consumed - 1`` of the epoch's order, and ``global_extra``, are consumed.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if consumed is None:
            consumed = self._handed_out[1] if self._handed_out[0] == epoch else 0
        layout = self._loaded if self._loaded is not None and self._loaded.epoch == epoch else None
        origin = (layout.consumed, layout.extra) if layout is not None else (0, ())
        counts = (
            [int(c) for c in consumed_by_rank]
            if consumed_by_rank is not None
            else [int(consumed)] * self.world_size
        )
        done = advance_position(
            self.dataset_size, *origin, world_size=self.world_size, drop_last=self.drop_last, counts=counts
        )
        return {
            "seed": self.seed,
            "epoch": epoch,
            "consumed": int(consumed),
            "dataset_size": self.dataset_size,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "layout_consumed": origin[0],
            "layout_extra": list(origin[1]),
            "global_consumed": done[0],
            "global_extra": done[1],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at a saved position: the saved epoch then skips the samples already seen.

        Skipped samples are never loaded: they are left out of the index list. With the
        saved world size (and ``drop_last``), each rank skips what it consumed of its own
        shard: the order is the uninterrupted run's, bit for bit. With another one, the
        epoch's samples not yet consumed are sharded over this run's ranks (see the class).
        At an epoch boundary (``consumed`` 0 everywhere, or ``"fresh"``) nothing is skipped.

        Raises:
            ValueError: for a position saved on a dataset of another size.
        """
        if int(state["dataset_size"]) != self.dataset_size:
            raise ValueError(
                f"TrainSampler.load_state_dict: the checkpoint was taken on a dataset of {state['dataset_size']} "
                f"samples, this one has {self.dataset_size}. Resume with the same dataset."
            )
        saved_world, saved_drop = int(state["world_size"]), bool(state.get("drop_last", self.drop_last))
        consumed = int(state["consumed"])
        by_rank = state.get("consumed_by_rank")
        counts = [int(c) for c in by_rank] if by_rank is not None else [consumed] * saved_world
        origin = (int(state.get("layout_consumed", 0)), tuple(int(p) for p in state.get("layout_extra", ())))
        if "global_consumed" in state:
            done = (int(state["global_consumed"]), tuple(int(p) for p in state["global_extra"]))
        else:  # a checkpoint of an older unison
            position = advance_position(
                self.dataset_size, *origin, world_size=saved_world, drop_last=saved_drop, counts=counts
            )
            done = (position[0], tuple(position[1]))
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        if state.get("fresh") or done == (0, ()):
            self._resume = None
        elif saved_world == self.world_size and saved_drop == self.drop_last:
            self._resume = _Resume(self.epoch, consumed, *origin)  # the saved shards: bitwise
        else:
            self._resume = _Resume(self.epoch, 0, *done)
        self._loaded = self._resume

    def _shard(self, resume: _Resume) -> list[int]:
        order = epoch_order(self.dataset_size, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        rest = [order[p] for p in remaining_positions(self.dataset_size, resume.consumed, resume.extra)]
        return layout_order(rest, self.world_size, self.drop_last)[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        resume = self._current()
        skip = resume.skip if resume is not None else 0
        if resume is not None and resume.resharded:
            shard: Iterator[int] = iter(self._shard(resume)[skip:])
        else:
            shard = itertools.islice(super().__iter__(), skip, None)  # skipped samples are never loaded
        self._handed_out = (self.epoch, skip)
        return self._counted(shard, self.epoch)

    def _counted(self, shard: Iterator[int], epoch: int) -> Iterator[int]:
        for index in shard:
            self._handed_out = (epoch, self._handed_out[1] + 1)
            yield index

    def __len__(self) -> int:
        resume = self._current()
        if resume is None:
            return self.num_samples
        if not resume.resharded:
            return self.num_samples - resume.skip
        rest = self.dataset_size - resume.consumed - len(resume.extra)
        per_rank = rest // self.world_size if self.drop_last else math.ceil(rest / self.world_size)
        return max(per_rank - resume.skip, 0)


class EvalSampler(Sampler[int]):
    """Shards a dataset for evaluation without padding: every sample exactly once.

    Rank ``r`` takes indices ``r, r + world_size, r + 2 * world_size, ...``. Shards differ in
    length by at most one, and a rank gets none when the dataset has fewer samples than
    there are ranks; unison's evaluator and metrics handle both, so metrics are exact at
    any world size. Order is deterministic: gathered per-rank outputs can be put back in
    dataset order (sample ``i`` is item ``i // world_size`` of rank ``i % world_size``).

    With ``shuffle=True`` each pass (each evaluation) deals a new permutation of the dataset
    instead, drawn from ``seed`` and the number of passes so far: the same on every rank, so
    the shards still hold every sample exactly once and sums over them are the same.

    Args:
        dataset: anything with ``__len__``.
        rank: this rank; default, the process group's.
        world_size: the number of shards; default, the process group's.
        shuffle: a new order at each pass (the shards' order is then not the dataset's).
        seed: the seed of the orders; pass the same on every rank.

    Example:
        >>> [list(EvalSampler(range(5), rank=r, world_size=2)) for r in range(2)]
        [[0, 2, 4], [1, 3]]
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"EvalSampler needs a dataset with __len__, got {type(dataset).__name__}.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"EvalSampler(seed=...) needs an int, got {type(seed).__name__}: {seed!r}")
        self.rank, self.world_size = _check_placement(rank, world_size)
        self.dataset_size = len(dataset)
        self.shuffle, self.seed = bool(shuffle), seed
        self.passes = 0
        """Passes dealt so far (with ``shuffle``, pass ``k`` uses the ``k``-th order)."""

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.rank, self.dataset_size, self.world_size))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.passes)
        self.passes += 1
        order = torch.randperm(self.dataset_size, generator=gen).tolist()
        return iter(order[self.rank :: self.world_size])

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.world_size))
