"""Rank function of tests/distributed/test_scale.py: unison's collectives in each part of a run, counted."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from _collective_probe import count_collectives
from torch.utils.data import TensorDataset

from unison import Events, create_evaluator, create_trainer, prepare_loaders, prepare_model
from unison.distributed import get_world_size
from unison.handlers import Checkpoint
from unison.metrics import Accuracy, Loss


def _nonzero(calls: dict) -> dict:
    return {name: n for name, n in calls.items() if n}


def collectives_by_part(folder: str, iters: int = 6, sync_every: int = 2) -> dict:
    """One epoch of ``iters`` iterations with a sync point every ``sync_every``, one evaluation
    (two metrics) and one checkpoint save: the collectives each part issues on this rank."""
    torch.set_num_threads(1)
    world = get_world_size()
    gen = torch.Generator().manual_seed(0)
    n = iters * 2 * world
    train = TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen))
    val = TensorDataset(
        torch.randn(world + 1, 4, generator=gen), torch.randint(0, 2, (world + 1,), generator=gen)
    )
    train_loader, val_loader = prepare_loaders(train, val, batch_size=2, seed=0)
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, F.cross_entropy, sync_every=sync_every)
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)})
    checkpoint = Checkpoint(
        Path(folder), {"model": model, "optimizer": optimizer}, trainer, every_epochs=None, at_end=False
    )
    checkpoint.attach()

    iterations: list[dict] = []
    open_probe: list = []

    def enter(_: object) -> None:
        probe = count_collectives()
        iterations.append(probe.__enter__())
        open_probe.append(probe)

    def leave(_: object) -> None:
        open_probe.pop().__exit__(None, None, None)

    trainer.add_event_handler(Events.ITERATION_STARTED, enter)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, leave)  # the last handler of the iteration
    sync_points: list[tuple[bool, dict]] = []
    engine_sync = trainer._sync

    def counted_sync(epoch_end: bool) -> None:
        with count_collectives() as calls:
            engine_sync(epoch_end)
        sync_points.append((epoch_end, _nonzero(calls)))

    trainer._sync = counted_sync  # what the engine calls at each sync point
    trainer.run(train_loader, max_epochs=1)
    trainer._sync = engine_sync
    with count_collectives() as evaluation:
        evaluator.run(val_loader)
    with count_collectives() as save:
        checkpoint.save(trainer)
    checkpoint.wait()
    return {
        "world_size": world,
        "iterations": [_nonzero(c) for c in iterations],
        "sync_points": sync_points,
        "evaluation": _nonzero(evaluation),
        "save": _nonzero(save),
        "saved": [p.name for p in Path(folder).glob("*.pt")],
    }
