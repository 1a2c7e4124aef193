"""Workers for tests/checkpoint/test_per_rank.py: handlers whose state is each rank's own.

Each rank trains a tiny model with a :class:`RankTally` attached: a per-rank value that differs
between ranks (it adds the rank and the batch's first target each iteration). A run saves, a
fresh run resumes from the file, and the worker returns what each rank's handler holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from unison.checkpoint import CheckpointError
from unison.distributed import get_rank, get_world_size, prepare_loaders, prepare_model
from unison.engine import Engine, Events, create_trainer
from unison.handlers import Checkpoint


class RankTally:
    """A handler whose state is per rank: a running tally that differs on every rank."""

    per_rank_state = True

    def __init__(self) -> None:
        self.tally = 0.0
        self.seen: list[float] = []

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.step)

    def step(self, engine: Engine) -> None:
        self.tally += 1000.0 * (get_rank() + 1) + float(engine.state.batch[1][0])

    def state_dict(self) -> dict[str, Any]:
        return {"tally": self.tally}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tally = float(state["tally"])


class ReshardedTally(RankTally):
    """A per-rank tally that continues at another world size: every rank takes the sum of all."""

    def load_state_dict_resharded(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        self.seen = [float(s["tally"]) for s in states]
        self.tally = sum(self.seen) / world_size


class SharedTally(RankTally):
    """The same handler without the declaration: saved from rank 0 for every rank."""

    per_rank_state = False


def _setup(folder: str, tally_cls: type | None) -> tuple[Engine, Checkpoint, Any, Any]:
    torch.manual_seed(0)
    model = prepare_model(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(12, 3), torch.arange(12) % 2)
    loader, _ = prepare_loaders(data, batch_size=2, seed=0)
    trainer = create_trainer(model, optimizer, F.cross_entropy)
    tally = tally_cls() if tally_cls is not None else None
    if tally is not None:
        tally.attach(trainer)
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, keep_last=None)
    checkpoint.attach()
    return trainer, checkpoint, tally, loader


def save_then_resume(folder: str, cls_name: str) -> dict[str, Any]:
    """Trains one epoch with a tally of ``cls_name``, then a fresh run resumes from its last file."""
    cls = {"RankTally": RankTally, "SharedTally": SharedTally}[cls_name]
    trainer, checkpoint, tally, loader = _setup(f"{folder}/{cls_name}", cls)
    trainer.run(loader, max_epochs=1)
    trained = tally.tally
    _, checkpoint2, tally2, _ = _setup(f"{folder}/{cls_name}", cls)
    checkpoint2.resume("auto")
    return {"rank": get_rank(), "trained": trained, "resumed": tally2.tally}


def count_save_collectives(folder: str) -> dict[str, dict[str, int]]:
    """The collectives of one save, with and without a per-rank handler attached."""
    from _collective_probe import count_collectives

    counts = {}
    for name, cls in (("without", None), ("with", RankTally)):
        trainer, checkpoint, _, loader = _setup(f"{folder}/{name}", cls)
        trainer.run(loader, max_epochs=1)
        with count_collectives() as calls:
            checkpoint._last_saved_iteration = -1  # noqa: SLF001 - save the same iteration again
            checkpoint.save(trainer)
        counts[name] = {k: v for k, v in calls.items() if v}
    return counts


def save_at_two(folder: str, cls_name: str) -> float:
    """Trains one epoch at this world size with a tally of ``cls_name``; returns this rank's tally."""
    cls = {"RankTally": RankTally, "ReshardedTally": ReshardedTally}[cls_name]
    trainer, _, tally, loader = _setup(f"{folder}/{cls_name}", cls)
    trainer.run(loader, max_epochs=1)
    return tally.tally


def resume_at_this_size(folder: str, cls_name: str) -> dict[str, Any]:
    """Resumes the file :func:`save_at_two` wrote at this world size: the error, or what was loaded."""
    cls = {"RankTally": RankTally, "ReshardedTally": ReshardedTally}[cls_name]
    _, checkpoint, tally, _ = _setup(f"{folder}/{cls_name}", cls)
    try:
        checkpoint.resume("auto")
    except CheckpointError as err:
        return {"error": str(err), "world_size": get_world_size()}
    return {"tally": tally.tally, "seen": tally.seen}
