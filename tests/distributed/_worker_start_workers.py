"""Workers for tests/distributed/test_worker_start.py: what a loader's worker process inherited."""

from __future__ import annotations

import os

from torch.utils.data import Dataset

from unison.distributed import prepare_loaders

MARK = "imported"
"""Set to the rank's PID below, in the rank: a forked worker sees that value, a worker
started by spawn or forkserver imports this module anew and sees ``"imported"``."""


class Marks(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> str:
        return MARK


def as_list(items: list[str]) -> list[str]:
    return items


def worker_marks() -> dict[str, list[str]]:
    """What the workers of this rank's training and evaluation loaders saw of ``MARK``."""
    global MARK
    MARK = str(os.getpid())
    train, val = prepare_loaders(Marks(), Marks(), batch_size=2, num_workers=2, collate_fn=as_list)
    assert train is not None and val is not None
    seen = {
        "train": [m for batch in train for m in batch],
        "val": [m for batch in val for m in batch],
    }
    return {"pid": [MARK], **seen}
