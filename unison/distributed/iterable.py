"""A stream split across ranks and DataLoader workers: each item read by one process only."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from itertools import compress, islice, repeat, zip_longest
from operator import itemgetter, length_hint
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from unison.distributed.primitives import get_rank, get_world_size


class ShardedStream(IterableDataset):
    """Yields this rank's and this worker's share of ``source``; see :func:`shard_stream`."""

    def __init__(self, source: Iterable[Any], *, rank: int, world_size: int, equal_length: bool) -> None:
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.equal_length = equal_length
        self.epoch = 0
        self._consumed = 0  # source items read by this process in the current epoch
        self._resume_from: int | None = None
        self._yielded: Iterator[bool] | None = None  # counts the items handed out (equal_length)
        self._ends = (0, 1)  # the position after the first item handed out, and between two

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``; passed on to the source when it has ``set_epoch``."""
        self.epoch = epoch
        set_source_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_source_epoch):
            set_source_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self._resume_from or 0
        self._resume_from = None
        self._consumed = start
        self._yielded = None
        # Item i of the source goes to rank i % W; the j-th item of a rank goes to worker
        # j % K. Items are read in rounds of W: with equal_length, an incomplete last round
        # is dropped, so every rank yields the same number of items whatever the length.
        # The rounds are cut, the other workers' rounds skipped and this process's items
        # counted by zip, islice, map and compress, in C: no Python call per item, and an
        # item this process does not yield costs only the source's own reading.
        width = self.world_size
        source = iter(self.source)
        if start and next(islice(source, start - 1, None), _END) is _END:
            return iter(())
        # round k after start (items start + kW ..) is worker (start // W + k) % K's; the
        # position after this process's n-th item is the end of its round
        first = (worker - start // width) % workers
        self._ends = (start + (first + 1) * width, workers * width)
        if not self.equal_length:
            return self._unequal(source, first, workers)
        if width == 1:
            items: Iterator[Any] = source if workers == 1 else islice(source, first, None, workers)
        else:
            rounds: Iterator[Any] = zip(*[source] * width, strict=False)
            if workers > 1:
                rounds = islice(rounds, first, None, workers)
            items = map(itemgetter(self.rank), rounds)
        # compress takes one True of these with each item it passes on, after the item (the same
        # object each time: nothing made per item); operator.length_hint tells how many were taken
        self._yielded = repeat(True, _MANY)
        return compress(items, self._yielded)

    def _unequal(self, source: Iterator[Any], first: int, workers: int) -> Iterator[Any]:
        """equal_length=False: the rounds padded with _END, the incomplete last one yielded too."""
        width = self.world_size
        rounds = zip_longest(*[source] * width, fillvalue=_END)
        end, step = self._ends
        for round_ in islice(rounds, first, None, workers):
            item = round_[self.rank]
            if item is _END:
                return
            if round_[-1] is _END:  # the stream's incomplete last round
                self._consumed = end - width + round_.index(_END)
                yield item
                return
            self._consumed = end
            end += step
            yield item

    def state_dict(self) -> dict[str, int]:
        """This process's position: the epoch and how many source items it has read up to its
        last yielded item."""
        if self._yielded is not None:
            taken = _MANY - length_hint(self._yielded)
            if taken:
                first_end, step = self._ends
                return {"epoch": self.epoch, "consumed": first_end + (taken - 1) * step}
        return {"epoch": self.epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resumes at ``state``: the next ``iter()`` skips the items read before it."""
        if not isinstance(state, dict) or not {"epoch", "consumed"} <= state.keys():
            raise ValueError(
                f"ShardedStream.load_state_dict(state=...) needs a dict with 'epoch' and 'consumed', got {state!r}; "
                "pass what ShardedStream.state_dict() returned."
            )
        size = len(self.source) if isinstance(self.source, Sized) else None
        for key, upper in (("epoch", None), ("consumed", size)):
            value = state[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < 0
                or (upper is not None and value > upper)
            ):
                bound = (
                    f"between 0 and {upper} (the source's length)"
                    if upper is not None
                    else "a non-negative int"
                )
                raise ValueError(
                    f"ShardedStream.load_state_dict(state=...): {key!r} is {value!r}, expected {bound}: a position "
                    "out of range would replay or skip the epoch. Pass what ShardedStream.state_dict() returned."
                )
        self.set_epoch(int(state["epoch"]))
        self._resume_from = int(state["consumed"])
        self._consumed = self._resume_from
        self._yielded = None

    def __repr__(self) -> str:
        return (
            f"ShardedStream({type(self.source).__name__}, rank={self.rank}, world_size={self.world_size}, "
            f"equal_length={self.equal_length})"
        )


_END = object()
_MANY = 1 << 62  # more items than any stream holds


def shard_stream(
    source: Iterable[Any],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    equal_length: bool = True,
) -> ShardedStream:
    """Splits an iterable across ranks and DataLoader workers, so each item is trained on once.

    Item ``i`` of ``source`` goes to rank ``i % world_size``; inside a DataLoader with
    ``num_workers=K``, a rank's items are dealt to its workers in turn. Every process
    iterates ``source`` from the start and skips the items of the others, so ``source``
    must yield the whole stream in every process, in the same order (do not split it by
    worker yourself).

    ``equal_length=True`` (the default) reads the stream in rounds of ``world_size`` items
    and drops an incomplete last round: at most ``world_size - 1`` items per epoch are not
    seen, and every rank yields the same number of items, so no rank waits in a collective
    (a gradient all-reduce) that another rank skipped. ``equal_length=False`` yields every
    item, and ranks may then differ by one item: use it only where nothing collective
    follows each batch (one rank, or an evaluation that gathers at the end).

    ``state_dict()`` / ``load_state_dict()`` record each process's position (the epoch and
    the number of source items read), which torchdata's ``StatefulDataLoader`` saves per
    worker. A resume re-reads the source and skips those items: it is exact when the source
    yields the same order again for the same epoch (a file list, a seeded shuffle that
    follows ``set_epoch``). ``set_epoch(epoch)`` is passed on to the source. Without loader
    workers (and with ``equal_length``) all ranks have read the same items at any save: the
    position is global, and a checkpoint resumes at another world size, reading the rest of
    the epoch in rounds of the new one; with workers each rank's position is its own.

    Args:
        source: an iterable that can be read again from its start, often an ``IterableDataset``.
        rank: this rank; default the current rank (0 outside a process group).
        world_size: the number of ranks; default the current world size.
        equal_length: drop the stream's last incomplete round so all ranks yield as many items.

    Example:
        >>> list(shard_stream(range(7), rank=1, world_size=3))
        [1, 4]
        >>> list(shard_stream(range(7), rank=0, world_size=3, equal_length=False))
        [0, 3, 6]

    Distributed:
        Build it on every rank, after the process group exists (the rank is read then).
    """
    if not isinstance(source, Iterable):
        raise TypeError(
            f"shard_stream(source=...) needs an iterable (an IterableDataset, a list), got "
            f"{type(source).__name__}: {source!r}."
        )
    if isinstance(source, Iterator):
        raise TypeError(
            f"shard_stream(source=...) got an iterator ({type(source).__name__}), which can be read only once: "
            "every epoch and every worker reads the source from its start. Pass what makes it (an "
            "IterableDataset whose __iter__ opens the stream, a list), not the iterator itself."
        )
    world = get_world_size() if world_size is None else world_size
    here = get_rank() if rank is None else rank
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"shard_stream(world_size=...) must be a positive int, got {world!r}.")
    if isinstance(here, bool) or not isinstance(here, int) or not 0 <= here < world:
        raise ValueError(
            f"shard_stream(rank=...) must be in [0, {world - 1}] for world_size={world}, got {here!r}."
        )
    return ShardedStream(source, rank=here, world_size=world, equal_length=bool(equal_length))
