"""Rank functions of tests/distributed/test_async_sharded_saves.py: asynchronous sharded saves
of an FSDP2 model and its AdamW, their copy kept from save to save, the optimizer's tensors
copied by the writer's thread while the next iteration runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from _ddp_workers import make_mlp
from _log_capture import LogRecords
from _sharded_workers import BATCH, dataset
from ignite.engine import Events
from torch import nn

from unison.checkpoint.snapshot import Pending
from unison.checkpoint.writer import CheckpointWriter
from unison.distributed import barrier, get_rank, prepare_loaders, prepare_model
from unison.distributed.fsdp import full_model_state
from unison.engine import create_trainer
from unison.handlers import Checkpoint


@contextmanager
def copies_held_until(release: threading.Event, taken: list[list[str]]) -> Iterator[None]:
    """The copies left for later wait for ``release`` (each then appends the key paths it copies
    to ``taken``)."""
    real = Pending.fill

    def held(self: Pending) -> list[str]:
        assert release.wait(60), "the copy left for later was never released"
        taken.append(list(self.names))
        return real(self)

    Pending.fill = held  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pending.fill = real  # type: ignore[method-assign]


@contextmanager
def released_by_the_step(release: threading.Event) -> Iterator[None]:
    """``release`` set as the optimizer's step waits for the copy (the writer's fence), or as the
    writer waits for its thread (the next save, the end of the run); cleared once the wait is over."""
    real_fence, real_wait = CheckpointWriter.fence, CheckpointWriter.wait

    def fence(self: CheckpointWriter) -> float:
        release.set()
        try:
            return real_fence(self)
        finally:
            release.clear()

    def wait(self: CheckpointWriter) -> None:
        release.set()
        try:
            real_wait(self)
        finally:
            release.clear()

    CheckpointWriter.fence, CheckpointWriter.wait = fence, wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        CheckpointWriter.fence, CheckpointWriter.wait = real_fence, real_wait  # type: ignore[method-assign]


def _fsdp_run(folder: str, **checkpoint: Any) -> tuple[nn.Module, Any, Any, Any, Checkpoint]:
    model = prepare_model(make_mlp(), strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(dataset(), None, batch_size=BATCH, seed=5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    saver = Checkpoint(
        folder, {"model": model, "optimizer": optimizer}, trainer, async_save=True, **checkpoint
    )
    return model, optimizer, loader, trainer, saver


def _same_as_saved(folder: str, at_save: dict[int, dict[str, torch.Tensor]], pattern: str) -> list[bool]:
    """Rank 0: whether each folder's model is the model gathered whole at its save."""
    from unison.checkpoint.consolidate import model_weights

    same = []
    for key, weights in sorted(at_save.items()):
        (path,) = Path(folder).glob(pattern.format(key))
        saved = model_weights(path)
        same.append(
            sorted(saved) == sorted(weights) and all(torch.equal(saved[k], weights[k]) for k in weights)
        )
    return same


def async_saves_kept(folder: str) -> dict[str, Any]:
    """Three asynchronous sharded saves by one Checkpoint, at three epoch ends, each save's copy of
    the optimizer's tensors held until the next step's wait (or the end of the run). Returns how
    many times this rank made a copy's buffers, the key paths each later copy took, this rank's
    sharded state's key paths, and on rank 0 whether each folder's model is the model at its
    save (gathered whole as the save was made)."""
    import torch.distributed._state_dict_utils as utils

    from unison.checkpoint.dcp_staging import staging_problem
    from unison.checkpoint.keypaths import tensors_with_paths
    from unison.checkpoint.sharded import dcp_states

    assert staging_problem() is None  # its check of the helpers, once a process: not counted below
    made: list[int] = []
    real = utils._create_cpu_state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    utils._create_cpu_state_dict = counted
    release, taken = threading.Event(), []
    try:
        model, optimizer, loader, trainer, checkpoint = _fsdp_run(folder, keep_last=None)
        at_save: dict[int, dict[str, torch.Tensor]] = {}
        trainer.add_event_handler(  # before the save, which runs after every handler of the epoch
            Events.EPOCH_COMPLETED,
            lambda e: at_save.update(
                {e.state.epoch: {k: v.clone() for k, v in full_model_state(model).items()}}
            ),
        )
        checkpoint.attach()
        with copies_held_until(release, taken), released_by_the_step(release):
            trainer.run(loader, max_epochs=3, epoch_length=2)
            checkpoint.wait()
    finally:
        utils._create_cpu_state_dict = real
    names = [
        n
        for n, _ in tensors_with_paths(
            dcp_states({"model": model, "optimizer": optimizer}, ["model", "optimizer"])
        )
    ]
    barrier()
    same = _same_as_saved(folder, at_save, "ckpt-e{:04d}-*.dcp") if get_rank() == 0 else None
    return {"made": len(made), "taken": taken, "names": names, "same": same}


def changed_on_one_rank(folder: str) -> dict[str, Any]:
    """Asynchronous sharded saves at iterations 1 (which makes the buffers), 2 and 4; after the
    second, rank 1 changes its shard of the first weight in place before its copy is taken
    (outside the optimizer's step).
    Returns the warnings, whether this rank still copies later, the folders and manifest left,
    and on rank 0 whether the last folder's model is the model at its save."""
    release, taken = threading.Event(), []
    model, _, loader, trainer, checkpoint = _fsdp_run(folder, every_epochs=None, at_end=False, keep_last=None)
    at_save: dict[int, dict[str, torch.Tensor]] = {}

    def save(engine: Any) -> None:
        checkpoint.save(engine)
        at_save[engine.state.iteration] = {k: v.clone() for k, v in full_model_state(model).items()}
        if engine.state.iteration == 2:
            if get_rank() == 1:
                with torch.no_grad():
                    next(iter(model.parameters())).mul_(
                        0.5
                    )  # outside the optimizer's step: breaks the promise
            release.set()  # only now is the copy taken

    for iteration in (1, 2, 4):
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), save)
    with LogRecords() as logs, copies_held_until(release, taken):
        trainer.run(loader, max_epochs=1, epoch_length=6)
        checkpoint.wait()
    barrier()
    rank0 = get_rank() == 0
    return {
        "warnings": [m for m in logs.messages if "changed in place" in m],
        "overlap": checkpoint.writer.overlap,
        "taken": taken,
        "entries": sorted(p.name for p in Path(folder).iterdir()),
        "manifest": [e.file for e in checkpoint.manifest.entries] if rank0 else None,
        "same": _same_as_saved(folder, {4: at_save[4]}, "ckpt-*-i{:09d}.dcp") if rank0 else None,
    }
