"""Workers for tests/checkpoint/test_custom_stream.py: a user's own stream with ``state_dict()``
in torchdata's ``StatefulDataLoader``, saved at one world size and resumed at another.

Two streams read the records ``range(SIZE)``: :class:`EveryWth` (rank r reads records
r, r + W, ...; its state is the global number of records read, the same on every rank, and it
declares that position global and elastic) and :class:`FileOffset` (each rank reads its own
slice; its state is the offset in that slice: a per-rank position).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from unison.checkpoint import CheckpointError
from unison.distributed import get_rank, get_world_size, prepare_model
from unison.distributed.primitives import broadcast_object
from unison.engine import Events, create_trainer
from unison.handlers import Checkpoint

SIZE = 24
BATCH = 2


class EveryWth(IterableDataset):
    """Rank r of W yields records r, r + W, ...; its state counts the records read by all ranks."""

    global_position = True  # its state is the same on every rank: any world size continues from it
    shards_itself = True

    def __init__(self) -> None:
        self.read = 0  # records of the whole stream read, by every rank together
        self._resume = 0

    def __iter__(self) -> Any:
        rank, world = get_rank(), get_world_size()
        self.read, self._resume = self._resume, 0
        start = self.read
        for first in range(start, SIZE - world + 1, world):  # whole rounds only: equal lengths
            self.read = first + world
            yield {"id": first + rank}

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = int(state["read"])


class FileOffset(IterableDataset):
    """Rank r of W yields its own contiguous slice of the records; its state is the offset in it."""

    shards_itself = True

    def __init__(self) -> None:
        self.offset = 0
        self._resume = 0

    def __iter__(self) -> Any:
        rank, world = get_rank(), get_world_size()
        size = SIZE // world
        self.offset, self._resume = self._resume, 0
        for i in range(rank * size + self.offset, (rank + 1) * size):
            self.offset += 1
            yield {"id": i}

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = int(state["offset"])


STREAMS = {"every-wth": EveryWth, "file-offset": FileOffset}


def prepare(batch: dict[str, torch.Tensor], device: torch.device, non_blocking: bool) -> tuple[Any, Any]:
    t = batch["id"].to(torch.float32).unsqueeze(-1)
    x = torch.cat([torch.sin(t), t / SIZE, torch.ones_like(t)], dim=-1)
    return x.to(device), (t / SIZE).squeeze(-1).to(device)


def build(stream: str, folder: str, **options: Any) -> tuple[Any, ...]:
    """Trainer, Checkpoint (attached), loader and the list of the ids each iteration trained."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = prepare_model(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(
        model, optimizer, lambda p, y: F.mse_loss(p.squeeze(-1), y), prepare_batch=prepare, sync_every=1
    )
    trained: list[list[int]] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: trained.append(e.state.batch["id"].tolist())
    )
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, **options)
    checkpoint.attach()
    return trainer, checkpoint, StatefulDataLoader(STREAMS[stream](), batch_size=BATCH), trained


def save_mid_epoch(folder: str, stream: str, stop: int) -> dict[str, Any]:
    """Trains ``stop`` iterations and stops (saved at the end): the path and what each rank trained."""
    trainer, checkpoint, loader, trained = build(stream, folder, every_epochs=None)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
    trainer.run(loader, max_epochs=1)
    path = broadcast_object(str(checkpoint.saved[-1]) if get_rank() == 0 else None)
    return {"path": path, "trained": trained}


def resume(folder: str, stream: str, path: str) -> dict[str, Any]:
    """Resumes ``path`` at this world size and trains the epoch to its end; or the error it raised."""
    trainer, checkpoint, loader, trained = build(stream, folder, every_epochs=None, at_end=False)
    try:
        checkpoint.resume(path)
        trainer.run(loader, max_epochs=1)
    except CheckpointError as err:
        return {"error": str(err)}
    return {"trained": trained}
