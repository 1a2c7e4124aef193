"""A stream loader's batches of indices, cut whole: torchdata's count, without a call per sample.

A stream has no indices: its loader asks for a batch of ``batch_size`` placeholders (``None``)
and reads that many items from the stream. torchdata's ``StatefulDataLoader`` builds each such
list one ``next`` and one ``append`` at a time and counts them (``samples_yielded``, saved in
its state); :class:`StreamBatches` yields the same lists, ``[None] * batch_size``, and the same
count, so a loader saves the same state with it as with torchdata's own batch sampler, and
loads a state saved by either.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from torch.utils.data.dataloader import _InfiniteConstantSampler

_SAMPLES_YIELDED = "samples_yielded"
"""The key of torchdata's batch-sampler state (``_BatchSamplerIterator.state_dict()``)."""


class _Batches:
    """The placeholders of one epoch's batches, and how many were handed out (a stream never ends
    them: the loader's fetcher stops when the stream does)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.samples_yielded = 0

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> list[None]:
        self.samples_yielded += self.batch_size
        return [None] * self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return {_SAMPLES_YIELDED: self.samples_yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.samples_yielded = state_dict[_SAMPLES_YIELDED]


class StreamBatches(BatchSampler):
    """Batches of ``batch_size`` placeholders for a stream's loader; its iterator saves and loads
    torchdata's batch-sampler state (``{"samples_yielded": n}``).

    Example:
        >>> batches = iter(StreamBatches(_InfiniteConstantSampler(), batch_size=3, drop_last=False))
        >>> next(batches), batches.state_dict()
        ([None, None, None], {'samples_yielded': 3})
    """

    def __iter__(self) -> _Batches:  # type: ignore[override]  # a stateful iterator, as torchdata's
        return _Batches(self.batch_size)


def cut_batches_whole(loader: DataLoader) -> DataLoader:
    """Gives a stream's loader :class:`StreamBatches` in place of torchdata's batch sampler.

    Only a loader over an ``IterableDataset`` with a batch size (its sampler the placeholder one
    torch gives every stream) is changed; any other is returned as it is. The loader refuses a new
    ``batch_sampler`` once built (it guards the attribute against users), hence ``object.__setattr__``.
    """
    old = loader.batch_sampler
    if (
        isinstance(loader.dataset, IterableDataset)
        and isinstance(old, BatchSampler)
        and type(old.sampler) is _InfiniteConstantSampler
    ):
        object.__setattr__(loader, "batch_sampler", StreamBatches(old.sampler, old.batch_size, old.drop_last))
    return loader
