"""Rank functions of tests/engine/test_checks.py: streams handed to a trainer in a plain DataLoader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from unison.distributed import get_rank, get_world_size
from unison.engine import Engine, Events


class WholeStream(IterableDataset):
    """Yields ``0 .. size-1`` in every process that iterates it: it splits by neither rank nor worker."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size))


class OwnShare(IterableDataset):
    """Yields only its process's share, by rank and by loader worker, and says so."""

    shards_itself = True

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        processes = get_world_size() * workers
        return iter(range(get_rank() * workers + worker, self.size, processes))


def train_on(stream: str, size: int, num_workers: int = 0) -> dict[str, Any]:
    """Runs a trainer one epoch over a plain DataLoader of ``stream``: the ids it trained, or its error."""
    dataset = {"whole": WholeStream, "own": OwnShare}[stream](size)
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = DataLoader(dataset, batch_size=2, num_workers=num_workers, **context)
    seen: list[int] = []
    trainer = Engine(lambda engine, batch: seen.extend(int(i) for i in batch), name="trainer")
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: None)
    try:
        trainer.run(loader, max_epochs=1)
    except ValueError as err:
        return {"error": str(err), "seen": seen}
    return {"error": None, "seen": sorted(seen), "sum": float(torch.tensor(seen).sum())}
