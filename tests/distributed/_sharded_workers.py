"""Rank functions of tests/distributed/test_sharded_checkpoint.py.

One small training job (an MLP, AdamW, a StepLR schedule, an EMA of the weights, a
resumable sampler) under DDP or FSDP2, which can stop after a given iteration (every rank
together) and resume from its checkpoint folder at any world size. Each run reports the
whole weights, the average, the learning rate and the samples it trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _ddp_workers import make_mlp
from ignite.engine import Events
from torch import nn
from torch.utils.data import TensorDataset

from unison.distributed import barrier, get_rank, prepare_loaders, prepare_model
from unison.distributed.fsdp import full_model_state, global_value
from unison.engine import create_trainer
from unison.handlers import EMA, Checkpoint

SAMPLES = 30
BATCH = 2


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 8, generator=gen)
    x[:, 0] = torch.arange(SAMPLES, dtype=torch.float32)  # the sample's index, read back from batches
    return TensorDataset(x, torch.randint(0, 3, (SAMPLES,), generator=gen))


def _ema_weights(ema: EMA) -> dict[str, torch.Tensor]:
    if ema.shards is not None:
        return {k: global_value(v).clone() for k, v in ema.shards.state().items()}
    return {k: v.clone() for k, v in ema.module.state_dict().items()}


def job(
    folder: str,
    strategy: str,
    epochs: int,
    *,
    stop_after: int | None = None,
    resume: bool = False,
    async_save: bool = False,
) -> dict[str, Any]:
    """Trains (or resumes and trains) until ``epochs`` or until ``stop_after`` iterations in all."""
    model = prepare_model(make_mlp(), strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader, _ = prepare_loaders(dataset(), None, batch_size=BATCH, seed=5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy, sync_every=1)  # stops act at once
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: schedule.step())
    ema = EMA(model, decay=0.8)
    ema.attach(trainer)
    checkpoint = Checkpoint(
        folder,
        {"model": model, "optimizer": optimizer, "scheduler": schedule},
        trainer,
        every_iters=4,
        keep_last=3,
    )
    checkpoint.attach()
    seen: list[tuple[int, int]] = []  # (epoch, sample index)
    at_start: dict[str, Any] = {}

    @trainer.on(Events.STARTED)
    def _loaded(_: Any) -> None:  # what the resume put back, before any step
        params = {k: v.clone() for k, v in full_model_state(model).items()}  # DDP's are the live tensors
        at_start.update(params=params, ema=_ema_weights(ema), lr=optimizer.param_groups[0]["lr"])

    @trainer.on(Events.ITERATION_COMPLETED)
    def _record(engine: Any) -> None:
        seen.extend((engine.state.epoch, int(i)) for i in engine.state.batch[0][:, 0].tolist())
        if stop_after is not None and engine.state.iteration == stop_after:
            engine.terminate()  # every rank at the same iteration

    if resume:
        checkpoint.resume("auto")
    trainer.run(loader, max_epochs=epochs)
    return {
        "rank": get_rank(),
        "params": {k: v.clone() for k, v in full_model_state(model).items()},
        "ema": _ema_weights(ema),
        "lr": optimizer.param_groups[0]["lr"],
        "seen": seen,
        "at_start": at_start,
        "epoch": trainer.state.epoch,
        "iteration": trainer.state.iteration,
    }


def nan_in_one_shard(folder: str, async_save: bool = False) -> dict[str, Any]:
    """Trains an FSDP model a few steps and saves; then puts a NaN into rank 1's shard only and saves
    again. Returns what each save returned on this rank, the folder's checkpoints and every entry
    of the folder once the saves are done."""
    from unison.distributed.fsdp import local_tensor

    model = prepare_model(make_mlp(), strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(dataset(), None, batch_size=BATCH, seed=5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    checkpoint = Checkpoint(
        folder, {"model": model, "optimizer": optimizer}, trainer, at_end=False, async_save=async_save
    )
    checkpoint.attach()
    trainer.run(loader, max_epochs=1, epoch_length=3)
    first = checkpoint.save(trainer)
    checkpoint.wait()
    trainer.state.iteration += 1  # another position, so the save is not skipped as already on disk
    if get_rank() == 1:
        with torch.no_grad():
            local_tensor(next(iter(model.parameters()))).view(-1)[0] = float("nan")
    second = checkpoint.save(trainer)
    checkpoint.wait()
    barrier()
    return {
        "first": first,
        "second": second,
        "saved": sorted(p.name for p in Path(folder).glob("ckpt-*")),
        "entries": sorted(p.name for p in Path(folder).iterdir()),
        "manifest": [e.file for e in checkpoint.manifest.entries] if get_rank() == 0 else None,
    }


def job_read_in_place(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`job` with every tensor record of a byte or more read straight into its shard
    (``unison.checkpoint.dcp_reads``; 1 MiB in a run); ``placed`` counts the items that were."""
    from unison.checkpoint import archive_load, dcp_reads

    placed: list[int] = []
    real_from, real_read = archive_load.IN_PLACE_FROM, dcp_reads.read_window

    def read_window(fd: int, offset: int, length: int, **options: Any) -> Any:
        loaded = real_read(fd, offset, length, **options)
        placed.append(int(loaded is options["into"].tensors))
        return loaded

    archive_load.IN_PLACE_FROM, dcp_reads.read_window = 1, read_window
    try:
        result = job(*args, **kwargs)
    finally:
        archive_load.IN_PLACE_FROM, dcp_reads.read_window = real_from, real_read
    return {**result, "placed": sum(placed), "read": len(placed)}


def files_checked_and_loaded(folder: str) -> dict[str, Any]:
    """:func:`job`'s objects resumed from ``folder``: the files this rank checksummed while choosing
    the checkpoint, and what its load read from each file: each item's key and whether it is a
    tensor's piece (DCP's description of each item)."""
    import unison.checkpoint.archive as archive_module
    import unison.checkpoint.safe_dcp as safe_dcp
    import unison.checkpoint.sharded_files as files_module

    model = prepare_model(make_mlp(), strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    EMA(model, decay=0.8).attach(trainer)
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer, "scheduler": schedule}, trainer)
    checked: list[str] = []
    loaded: dict[str, list[tuple[str, bool]]] = {}
    real_checksum, real_read = files_module.file_checksum, safe_dcp.read_in_place

    def checksum(path: Path) -> tuple[int, int]:
        checked.append(path.name)
        return real_checksum(path)

    def read_in_place(folder: Path, storage_data: Any, plan: Any, planner: Any) -> list[Any]:
        for item in plan.items:
            piece = (item.storage_index.fqn, item.type.name == "TENSOR")
            loaded.setdefault(storage_data[item.storage_index].relative_path, []).append(piece)
        return real_read(folder, storage_data, plan, planner)

    rest_reads: list[str] = []  # each read of a folder's rest.pt: its records loaded, or checked only
    real_archive, real_complete = archive_module.read_archive, archive_module.archive_complete

    def read_archive(path: Any, **options: Any) -> Any:
        rest_reads.extend(
            ["loaded" + (", checked" if options.get("verify", True) else "")] * (Path(path).name == "rest.pt")
        )
        return real_archive(path, **options)

    def archive_complete(path: Any) -> bool:
        rest_reads.extend(["checked"] * (Path(path).name == "rest.pt"))
        return real_complete(path)

    files_module.file_checksum, safe_dcp.read_in_place = checksum, read_in_place
    archive_module.read_archive, archive_module.archive_complete = read_archive, archive_complete
    try:
        resumed = checkpoint.resume("auto")
    finally:
        files_module.file_checksum, safe_dcp.read_in_place = real_checksum, real_read
        archive_module.read_archive, archive_module.archive_complete = real_archive, real_complete
    return {
        "resumed": None if resumed is None else resumed.name,
        "checked": checked,
        "loaded": loaded,
        "rest_reads": rest_reads,
    }


def save_collectives(folder: str, background: bool) -> dict[str, Any]:
    """An FSDP model saved once (warm: DCP's and unison's groups made), then saved again at the next
    position with its collectives counted (every ``torch.distributed`` call on this rank, DCP's
    included), over the temporary folder a save that died there would have left; ``background``:
    an asynchronous save, waited for inside the count."""
    from _collective_probe import count_collectives

    model = prepare_model(make_mlp(), strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(dataset(), None, batch_size=BATCH, seed=5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    checkpoint = Checkpoint(
        folder, {"model": model, "optimizer": optimizer}, trainer, at_end=False, async_save=background
    )
    trainer.run(loader, max_epochs=1, epoch_length=2)
    checkpoint.save(trainer)
    checkpoint.wait()
    trainer.state.iteration += 1  # another position, so the save is not skipped as already on disk
    if get_rank() == 0:  # what a save that died at this position would have left: gone before any rank writes
        stale = Path(folder) / f".ckpt-e{trainer.state.epoch:04d}-i{trainer.state.iteration:09d}.dcp.tmp"
        stale.mkdir()
        for name in ("__9_0.distcp", ".metadata", "__1_0.distcp"):
            (stale / name).write_bytes(b"left by a save that died")
    with count_collectives() as calls:
        saved = checkpoint.save(trainer)
        checkpoint.wait()
    return {"calls": {k: v for k, v in calls.items() if v}, "saved": None if saved is None else saved.name}


def load_collectives(folder: str, fail_on: int | None) -> dict[str, Any]:
    """An FSDP model and AdamW saved once, their weights and state then put aside and the folder
    loaded back with ``load_dcp_states`` with its collectives counted (every ``torch.distributed``
    call on this rank, DCP's included). ``fail_on``: that rank's read of its shards fails (an
    ``OSError``); every rank reports the error it raised instead."""
    from _collective_probe import count_collectives

    import unison.checkpoint.safe_dcp as safe_dcp
    from unison.checkpoint.checkpoint_error import CheckpointError
    from unison.checkpoint.sharded import load_dcp_states
    from unison.distributed import broadcast_object

    model = prepare_model(make_mlp(), strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(dataset(), None, batch_size=BATCH, seed=5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    objects = {"model": model, "optimizer": optimizer}
    checkpoint = Checkpoint(folder, objects, trainer, at_end=False)
    trainer.run(loader, max_epochs=1, epoch_length=2)
    saved = broadcast_object(checkpoint.save(trainer))  # rank 0 records the save
    assert saved is not None
    shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
    moments = [s["exp_avg"].to_local().clone() for s in optimizer.state.values()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for s in optimizer.state.values():
            s["exp_avg"].zero_()
    if fail_on == get_rank():

        def unreadable(*_: Any) -> Any:
            raise OSError("the shard's disk went away")

        safe_dcp.read_in_place = unreadable  # type: ignore[assignment]
    error = None
    with count_collectives() as calls:
        try:
            load_dcp_states(saved, objects, ["model", "optimizer"])
        except CheckpointError as err:
            error = (type(err).__name__, str(err))
    restored = all(torch.equal(p.to_local(), shards[n]) for n, p in model.named_parameters()) and all(
        torch.equal(s["exp_avg"].to_local(), m)
        for s, m in zip(optimizer.state.values(), moments, strict=True)
    )
    barrier()
    return {"calls": {k: v for k, v in calls.items() if v}, "error": error, "restored": restored}
