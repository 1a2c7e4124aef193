"""Workers for tests/checkpoint/test_stream_elastic.py: a ``shard_stream`` saved at one world size,
resumed at another.

Every run trains a tiny linear model on samples named by an id, read from a stream that
shuffles its ids by epoch; each rank records the epoch and the ids of every batch it trained.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

from unison.distributed import get_rank, prepare_model, shard_stream
from unison.distributed.primitives import broadcast_object
from unison.engine import Events, create_trainer
from unison.handlers import Checkpoint

SIZE = 20
BATCH = 2
MAX_EPOCHS = 2


class Shuffled(IterableDataset):
    """``{"id": i}`` for the ids of ``range(size)``, in an order drawn from the epoch."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(100 + self.epoch))
        return iter({"id": int(i)} for i in order)


def prepare(batch: dict[str, torch.Tensor], device: torch.device, non_blocking: bool) -> tuple[Any, Any]:
    t = batch["id"].to(torch.float32).unsqueeze(-1)
    x = torch.cat([torch.sin(t), torch.cos(0.5 * t), t / SIZE, torch.ones_like(t)], dim=-1)
    return x.to(device), ((t / SIZE).squeeze(-1) * 2 - 1).to(device)


def build(folder: str, num_workers: int = 0, **options: Any) -> tuple[Any, ...]:
    """Model, trainer, Checkpoint (attached), loader and the list of what the trainer trains."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = prepare_model(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(
        model, optimizer, lambda p, y: F.mse_loss(p.squeeze(-1), y), prepare_batch=prepare, sync_every=1
    )
    trained: list[tuple[int, list[int]]] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: trained.append((e.state.epoch, e.state.batch["id"].tolist()))
    )
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, **options)
    checkpoint.attach()
    loader = StatefulDataLoader(shard_stream(Shuffled()), batch_size=BATCH, num_workers=num_workers)
    return model, trainer, checkpoint, loader, trained


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def resume(folder: str, path: str) -> dict[str, Any]:
    """Resumes ``path`` at this world size and trains to the end."""
    model, trainer, checkpoint, loader, trained = build(folder, every_epochs=None, at_end=False)
    checkpoint.resume(path)
    trainer.run(loader, max_epochs=MAX_EPOCHS)
    return {"trained": trained, "weights": flat(model), "epoch_length": trainer.state.epoch_length}


def save_and_resume(folder: str, every_iters: int) -> dict[str, Any]:
    """At this world size: the uninterrupted run, saving every ``every_iters`` iterations, then
    a resume of each of its checkpoints at the same world size."""
    model, trainer, checkpoint, loader, trained = build(
        f"{folder}/a", every_iters=every_iters, every_epochs=None, keep_last=None, at_end=False
    )
    trainer.run(loader, max_epochs=MAX_EPOCHS)
    paths = broadcast_object([str(p) for p in checkpoint.saved] if get_rank() == 0 else [])
    out: dict[str, Any] = {"trained": trained, "weights": flat(model), "paths": paths, "resumed": []}
    for i, path in enumerate(paths):
        out["resumed"].append(resume(f"{folder}/r{i}", path))
    return out


def resume_each(folder: str, paths: list[str]) -> list[dict[str, Any]]:
    """Resumes every checkpoint of ``paths`` at this world size."""
    return [resume(f"{folder}/m{i}", path) for i, path in enumerate(paths)]
