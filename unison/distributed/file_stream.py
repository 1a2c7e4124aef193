"""Samples read from files in order, a new order each epoch: the source a file stream is sharded over."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

Reader = Callable[..., Iterable[Any]]


class FileStream(IterableDataset):
    """The samples of ``files`` as ``reader(path, **kwargs)`` yields them, file after file.

    Each epoch reads the files in an order drawn from ``(seed, epoch)``; with
    ``shuffle_buffer=n``, the samples also pass through a buffer of ``n`` that gives out a
    random one of them (drawn from the same generator) for each sample read. The order of an
    epoch is the same in every process and at every read, which is what
    :func:`~unison.distributed.shard_stream` needs of its source: wrap it to give each rank
    and each worker its share, with a position that resumes exactly.

    Args:
        files: the files, in a fixed order (sorted, say): every process must list the same.
        reader: ``reader(path, **kwargs)`` -> an iterable of the file's samples, in a fixed order.
        seed: the seed of every epoch's order (``training.seed``).
        kwargs: keyword arguments of ``reader``.
        shuffle_buffer: samples held in the shuffle buffer; 0 keeps each file's order.

    Example:
        >>> stream = FileStream(["a", "b"], lambda path: [path + "0", path + "1"], seed=0)
        >>> sorted(stream)
        ['a0', 'a1', 'b0', 'b1']
    """

    def __init__(
        self,
        files: Sequence[Path | str],
        reader: Reader,
        *,
        seed: int,
        kwargs: dict[str, Any] | None = None,
        shuffle_buffer: int = 0,
    ) -> None:
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise ValueError(f"FileStream(shuffle_buffer=...) must be an int >= 0, got {shuffle_buffer!r}.")
        self.files = list(files)
        self.reader = reader
        self.seed = seed
        self.kwargs = dict(kwargs or {})
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reads the files in epoch ``epoch``'s order from the next ``iter()`` on."""
        self.epoch = epoch

    def order(self) -> list[Path | str]:
        """The files in the current epoch's order."""
        files = list(self.files)
        random.Random(f"{self.seed}:{self.epoch}").shuffle(files)
        return files

    def __iter__(self) -> Iterator[Any]:
        # chained in C: without a shuffle buffer a sample costs only the reader's own work
        samples = chain.from_iterable(self.reader(path, **self.kwargs) for path in self.order())
        if self.shuffle_buffer <= 1:
            return samples
        return self._shuffled(samples, self.epoch)

    def _shuffled(self, samples: Iterator[Any], epoch: int) -> Iterator[Any]:
        draw = random.Random(f"{self.seed}:{epoch}:buffer")
        buffer: list[Any] = []
        for sample in samples:
            buffer.append(sample)
            if len(buffer) == self.shuffle_buffer:
                k = draw.randrange(len(buffer))
                buffer[k], buffer[-1] = buffer[-1], buffer[k]
                yield buffer.pop()
        draw.shuffle(buffer)
        yield from buffer

    def __repr__(self) -> str:
        return f"FileStream({len(self.files)} files, seed={self.seed}, shuffle_buffer={self.shuffle_buffer})"


def read_files(
    files: Sequence[Path | str], reader: Reader, kwargs: dict[str, Any] | None = None
) -> list[Any]:
    """Every sample of ``files``, in order, as a list: a map-style dataset (validation data)."""
    return [sample for path in files for sample in reader(path, **(kwargs or {}))]
