"""Workers for tests/checkpoint/test_data_state.py: runs over data that keeps its own position.

Every run trains a tiny linear model on samples named by an id; each rank records the ids of
every batch it trained on. :func:`resume_from_every_save` runs once uninterrupted, saving
after every iteration, then resumes a run built from scratch from each of those checkpoints
and returns what every run trained and the weights it ended with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from unison.checkpoint import CheckpointError
from unison.distributed import TrainSampler, get_rank, get_world_size, prepare_model
from unison.distributed.worker_start import worker_context
from unison.engine import Events, create_trainer
from unison.handlers import Checkpoint, Preemption

SIZE = 20
BATCH = 2


def features(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample of each id: 4 features and a target, a fixed function of the id."""
    t = ids.to(torch.float32).unsqueeze(-1)
    x = torch.cat([torch.sin(t), torch.cos(0.5 * t), t / SIZE, torch.ones_like(t)], dim=-1)
    return x, (t / SIZE).squeeze(-1) * 2 - 1


def prepare(batch: dict[str, torch.Tensor], device: torch.device, non_blocking: bool) -> tuple[Any, Any]:
    x, y = features(batch["id"])
    return x.to(device), y.to(device)


class StreamShard(IterableDataset):
    """The ids of ``range(size)`` with ``id % world_size == rank``, split over loader workers, in order.

    Its state is how many ids this copy (a worker's, or the main process's) gave out.
    """

    shards_itself = True  # by rank (given) and by worker

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.ids = [i for i in range(size) if i % world_size == rank]
        self.given = 0
        self._resume = 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        ids = self.ids[info.id :: info.num_workers] if info is not None else self.ids
        self.given, self._resume = self._resume, 0
        for i in ids[self.given :]:
            self.given += 1
            yield {"id": i}

    def state_dict(self) -> dict[str, int]:
        return {"given": self.given}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = int(state["given"])


class PlainStream(IterableDataset):
    """The same ids, without a state: nothing can tell where it stands."""

    shards_itself = True  # by rank (given); read without loader workers

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.ids = [i for i in range(size) if i % world_size == rank]

    def __iter__(self) -> Any:
        return iter({"id": i} for i in self.ids)


class Ids(Dataset):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"id": i}


def make_loader(source: str, num_workers: int = 0) -> Any:
    """This rank's training data for ``source``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    rank, world = get_rank(), get_world_size()
    # Workers forked from the rank, as prepare_loaders starts them (worker_start.py).
    workers = worker_context(num_workers, {"num_workers": num_workers})
    if source == "stateful-shard":
        return StatefulDataLoader(StreamShard(SIZE, rank, world), batch_size=BATCH, **workers)
    if source == "train-sampler":
        sampler = TrainSampler(Ids(), seed=3)
        return StatefulDataLoader(Ids(), batch_size=BATCH, sampler=sampler, **workers)
    if source == "hf-stream":
        from datasets import Dataset as HFDataset
        from datasets.distributed import split_dataset_by_node

        stream = HFDataset.from_dict({"id": list(range(SIZE))}).to_iterable_dataset(num_shards=4)
        return DataLoader(split_dataset_by_node(stream, rank=rank, world_size=world), batch_size=BATCH)
    if source == "plain-stream":
        return DataLoader(PlainStream(SIZE, rank, world), batch_size=BATCH)
    raise ValueError(source)


def build(source: str, folder: str, *, num_workers: int = 0, **options: Any) -> tuple[Any, ...]:
    """Model, trainer, Checkpoint (attached) and loader, built from scratch as a new job would."""
    torch.manual_seed(0)
    model = prepare_model(nn.Linear(4, 1))
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
    return model, trainer, checkpoint, make_loader(source, num_workers), trained


def close(loader: Any) -> None:
    """Ends the loader's worker processes now: a run that stops where its epoch_length says,
    before the data ran out, leaves its iterator (and its workers) alive."""
    shutdown = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def resume_from_every_save(
    folder: str, source: str, num_workers: int = 0, max_epochs: int = 2
) -> dict[str, Any]:
    """The uninterrupted run (saving after every iteration), then one resumed run per checkpoint."""
    options = {"every_iters": 1, "keep_last": None, "at_end": False}
    model, trainer, checkpoint, loader, trained = build(
        source, f"{folder}/a", num_workers=num_workers, **options
    )
    trainer.run(loader, max_epochs=max_epochs)
    close(loader)
    out: dict[str, Any] = {
        "weights": flat(model),
        "trained": trained,
        "epoch_length": trainer.state.epoch_length,
        "resumed": {},
    }
    saved = sorted(Path(folder, "a").glob("*.pt")) if get_rank() == 0 else []
    from unison.distributed.primitives import broadcast_object

    for i, path in enumerate(broadcast_object([str(p) for p in saved])):
        model, trainer, checkpoint, loader, again = build(
            source, f"{folder}/r{i}", num_workers=num_workers, every_epochs=None, at_end=False
        )
        checkpoint.resume(path)
        at = trainer.state.iteration
        trainer.run(loader, max_epochs=max_epochs)
        close(loader)
        out["resumed"][at] = {
            "weights": flat(model),
            "trained": again,
            "epoch_length": trainer.state.epoch_length,
        }
    return out


def refused_at_started(folder: str, source: str, preemption: bool = False) -> str | None:
    """The error a run over ``source`` raises at STARTED when it would save mid-epoch; None if it trains."""
    options: dict[str, Any] = {"every_iters": None} if preemption else {"every_iters": 3}
    model, trainer, checkpoint, loader, trained = build(source, folder, **options)
    if preemption:
        Preemption(checkpoint, exit=False).attach(trainer)
    try:
        trainer.run(loader, max_epochs=1)
    except ValueError as err:
        return f"{str(err)} [trained {len(trained)} batches]"
    return None


def save_mid_epoch(folder: str, source: str, stop: int) -> str | None:
    """Trains until ``stop`` (terminate, saved at the end); the checkpoint's path on rank 0."""
    model, trainer, checkpoint, loader, trained = build(source, folder, every_iters=None, keep_last=None)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
    trainer.run(loader, max_epochs=2)
    return str(checkpoint.saved[-1]) if checkpoint.saved else None


def resume_error(folder: str, path: str, source: str) -> str | None:
    """The error resuming ``path`` raises at this world size; None if it resumes."""
    model, trainer, checkpoint, loader, trained = build(source, folder, every_epochs=None)
    try:
        checkpoint.resume(path)
    except CheckpointError as err:
        return str(err)
    return None
