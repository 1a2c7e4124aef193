"""Training set-ups and rank functions of the checkpoint, resume and preemption tests.

``run_distributed`` sends a function by name; spawned ranks import this small module rather
than the test modules (which would import pytest in every rank). Each rank function builds
its runs from scratch, trains, and returns plain data or tensors for the test to assert on
in the parent process. The same functions run in-process at world size 1.

The model has dropout (so each rank's generator state matters to a resume) and is trained
with Adam (so the optimizer's state matters); the data comes through ``prepare_loaders``
(a :class:`~unison.distributed.TrainSampler`, so a mid-epoch resume must skip what was
consumed). The dataset records which indices were loaded.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from unison.checkpoint import capture_rng
from unison.distributed import (
    TrainSampler,
    get_rank,
    get_world_size,
    prepare_loaders,
    prepare_model,
    unwrap_model,
)
from unison.engine import Engine, Events, create_trainer
from unison.handlers import Checkpoint, EarlyStopping, Preemption
from unison.utils import manual_seed

D_IN, D_HIDDEN, N_CLASSES = 6, 16, 3
SIZE, BATCH = 20, 4
"""The default dataset size and per-rank batch size: 5 batches an epoch on 1 rank, 3 on 2
(the last one short), so epochs end on a short window with k=2, and on 2 ranks on a
partial batch."""


class RecordingDataset(Dataset):
    """A fixed classification dataset that records which indices were loaded, in order."""

    def __init__(self, size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, D_IN, generator=gen)
        self.y = torch.randint(0, N_CLASSES, (size,), generator=gen)
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded.append(int(index))
        return self.x[index], self.y[index]


class Chunks:
    """A custom batch sampler: the sampler's indices in batches of ``sizes[0], sizes[1], ...`` (cycled).

    It has no ``batch_size``: a DataLoader built on it reports ``batch_size=None``.
    """

    def __init__(self, sampler: TrainSampler, sizes: tuple[int, ...]) -> None:
        self.sampler = sampler
        self.sizes = sizes

    def __iter__(self):
        indices, sizes = list(self.sampler), itertools.cycle(self.sizes)
        while indices:
            n = next(sizes)
            yield indices[:n]
            indices = indices[n:]

    def __len__(self) -> int:
        return sum(1 for _ in self)


def make_model(seed: int = 0, dropout: float = 0.3) -> nn.Module:
    """An MLP with dropout; its initial weights depend on ``seed`` only (the global generator is kept)."""
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(D_IN, D_HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(D_HIDDEN, N_CLASSES)
    )
    torch.set_rng_state(saved)
    return model


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in unwrap_model(model).parameters()])


def rank_seed(seed: int, rank: int) -> int:
    """Each rank's own seed for its random stream (dropout), as a job script would set it."""
    return seed * 1000 + 17 * rank + 1


def epoch_length(size: int, batch_size: int, world_size: int) -> int:
    """Batches per epoch on each rank: the shard is padded to ``ceil(size / world_size)``."""
    return math.ceil(math.ceil(size / world_size) / batch_size)


def window_end(iteration: int, length: int, k: int) -> int:
    """The iteration that closes the accumulation window ``iteration`` belongs to.

    Windows of ``k`` restart at each epoch and the epoch's last one may be shorter: the
    specification in ``TrainStep``'s docstring.
    """
    position = (iteration - 1) % length + 1  # 1-based, within the epoch
    end = min(math.ceil(position / k) * k, length)
    return iteration - position + end


def first_sync_at_or_after(iteration: int, sync_every: int, length: int) -> int:
    """The first sync point of the trainer at or after ``iteration``: every ``sync_every``
    iterations, and at every epoch's end."""
    i = iteration
    while i % sync_every and i % length:
        i += 1
    return i


@dataclass
class Run:
    """One training run, built from scratch as a fresh job would build it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Engine
    loader: Any
    dataset: RecordingDataset
    checkpoint: Checkpoint | None = None
    per_epoch_loaded: dict[int, list[int]] = field(default_factory=dict)


def build_parts(
    *,
    size: int = SIZE,
    batch_size: int = BATCH,
    accumulation: int = 1,
    seed: int = 0,
    sync_every: int | None = 1,
    rng_seed: int | None = None,
    amp: str | None = None,
    batch_sizes: tuple[int, ...] | None = None,
    num_workers: int = 0,
) -> Run:
    """Seeds this rank, builds model (DDP above one rank), Adam, loader and trainer.

    With ``batch_sizes`` the loader takes a custom batch sampler (:class:`Chunks`) over a
    TrainSampler instead of ``batch_size``.
    """
    manual_seed(rng_seed if rng_seed is not None else rank_seed(seed, get_rank()))
    model = prepare_model(make_model(seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    dataset = RecordingDataset(size, seed)
    if batch_sizes is None:
        loader, _ = prepare_loaders(dataset, batch_size=batch_size, seed=seed, num_workers=num_workers)
    else:
        loader = DataLoader(dataset, batch_sampler=Chunks(TrainSampler(dataset, seed=seed), batch_sizes))
    trainer = create_trainer(
        model, optimizer, F.cross_entropy, accumulation_steps=accumulation, sync_every=sync_every, amp=amp
    )
    run = Run(model, optimizer, trainer, loader, dataset)

    @trainer.on(Events.EPOCH_COMPLETED)
    def _record_loaded(engine: Engine) -> None:
        run.per_epoch_loaded[engine.state.epoch] = list(dataset.loaded)
        dataset.loaded.clear()

    @trainer.on(Events.TERMINATE)
    def _record_partial_epoch(engine: Engine) -> None:
        if dataset.loaded:
            run.per_epoch_loaded[engine.state.epoch] = list(dataset.loaded)
            dataset.loaded.clear()

    return run


def build_run(folder: str, *, checkpoint: dict[str, Any] | None = None, **parts: Any) -> Run:
    """:func:`build_parts` with a Checkpoint of model and optimizer on ``folder``, keeping all files."""
    run = build_parts(**parts)
    options = {"keep_last": None, **(checkpoint or {})}
    run.checkpoint = Checkpoint(
        folder, {"model": run.model, "optimizer": run.optimizer}, run.trainer, **options
    )
    run.checkpoint.attach()
    return run


def stop_at(trainer: Engine, iteration: int, rank: int | None = None) -> None:
    """Calls ``trainer.terminate()`` after ``iteration`` (on ``rank`` only, or on every rank)."""

    @trainer.on(Events.ITERATION_COMPLETED(once=iteration))
    def _stop(engine: Engine) -> None:
        if rank is None or get_rank() == rank:
            engine.terminate()


def meta_of(path: Path | str | None) -> dict[str, Any] | None:
    """The file name and position of a checkpoint, read with ``weights_only=True``."""
    if path is None:
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {"file": Path(path).name, **{k: state["meta"][k] for k in ("epoch", "iteration", "mid_epoch")}}


class LogRecords(logging.Handler):
    """Collects the records of the ``unison`` logger at WARNING and above while installed."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    def __enter__(self) -> LogRecords:
        logger = logging.getLogger("unison")
        self._level = logger.level
        if logger.getEffectiveLevel() > logging.WARNING:
            logger.setLevel(logging.WARNING)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logger = logging.getLogger("unison")
        logger.removeHandler(self)
        logger.setLevel(self._level)


# --- resume equivalence ---------------------------------------------------------------------------


def resume_equivalence(
    folder: str,
    *,
    stop: int,
    max_epochs: int,
    control: bool = False,
    epoch_length: int | None = None,
    **parts: Any,
) -> dict[str, Any]:
    """Run A uninterrupted; run B stopped by ``terminate()`` after iteration ``stop`` (saving at
    the end); then run B', built from scratch and seeded afresh as a new process would be,
    resuming from B's folder. Returns their parameters and what each loaded.

    With ``control``, also an uninterrupted run whose ranks draw another random stream (other
    dropout masks): it must end elsewhere, or the comparison would not test the generators.
    """
    a = build_run(f"{folder}/a", **parts)
    a.trainer.run(a.loader, max_epochs=max_epochs, epoch_length=epoch_length)

    b1 = build_run(f"{folder}/b", **parts)
    stop_at(b1.trainer, stop)
    b1.trainer.run(b1.loader, max_epochs=max_epochs, epoch_length=epoch_length)

    b2 = build_run(f"{folder}/b", **parts)
    resumed = b2.checkpoint.resume("auto")
    b2.trainer.run(b2.loader, max_epochs=max_epochs, epoch_length=epoch_length)

    out: dict[str, Any] = {
        "a": flat_params(a.model),
        "b": flat_params(b2.model),
        "a_loss": a.trainer.state.metrics.get("loss"),
        "b_loss": b2.trainer.state.metrics.get("loss"),
        "a_iteration": a.trainer.state.iteration,
        "b_iteration": b2.trainer.state.iteration,
        "stopped": b1.trainer.state.iteration,
        "epoch_length": a.trainer.state.epoch_length,
        "resumed": meta_of(resumed),
        "a_loaded": a.per_epoch_loaded,
        "b1_loaded": b1.per_epoch_loaded,
        "b2_loaded": b2.per_epoch_loaded,
    }
    if control:
        c = build_run(f"{folder}/control", **{**parts, "rng_seed": 99_991 + get_rank()})
        c.trainer.run(c.loader, max_epochs=max_epochs, epoch_length=epoch_length)
        out["control"] = flat_params(c.model)
    return out


def in_place_resume(folder: str, scenario: dict[str, Any]) -> dict[str, Any]:
    """:func:`resume_equivalence` with every record of a byte or more read straight into the run's
    own tensors (``unison.checkpoint.in_place``; 1 MiB in a run), and the key paths that were."""
    from unison.checkpoint import archive_load

    placed: list[tuple[Any, ...]] = []
    real_from, real_put = archive_load.IN_PLACE_FROM, archive_load.put

    def put(state: Any, keys: tuple[Any, ...], value: Any) -> None:
        placed.append(keys)
        real_put(state, keys, value)

    archive_load.IN_PLACE_FROM, archive_load.put = 1, put
    try:
        result = resume_equivalence(folder, **scenario)
    finally:
        archive_load.IN_PLACE_FROM, archive_load.put = real_from, real_put
    return {**result, "placed": placed}


def resume_scenarios(folder: str, scenarios: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """:func:`resume_equivalence` for each named scenario, each in its own sub-folder."""
    return {name: resume_equivalence(f"{folder}/{name}", **kwargs) for name, kwargs in scenarios.items()}


# --- what a checkpoint holds ----------------------------------------------------------------------


CONFIG = {
    "model": {"hidden": D_HIDDEN, "dropout": 0.3},
    "training": {"lr": 0.05, "epochs": 3},
    "tags": ["a", "b"],
}


def checkpoint_contents(folder: str, *, stop_epoch_position: int = 2) -> dict[str, Any]:
    """Trains with fp16 autocast (a GradScaler), an LR scheduler, EarlyStopping and a config;
    stops inside epoch 2 so the last checkpoint is mid-epoch. Returns what each rank knows
    of its state at the save, to compare with the file."""
    run = build_parts(amp="fp16")
    step = run.trainer._process_function
    scaler = step.scaler
    scheduler = torch.optim.lr_scheduler.StepLR(run.optimizer, step_size=1, gamma=0.5)
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: scheduler.step())
    early = EarlyStopping(run.trainer, "loss", patience=50, mode="min")
    early.attach(run.trainer)
    at_save: dict[str, Any] = {}

    @run.trainer.on(Events.TERMINATE)
    def _state_at_save(engine: Engine) -> None:  # attached before the Checkpoint: runs just before its save
        at_save["torch_rng"] = torch.get_rng_state()
        at_save["rng"] = capture_rng()
        at_save["optimizer"] = copy.deepcopy(run.optimizer.state_dict())
        at_save["iteration"] = engine.state.iteration
        at_save["epoch"] = engine.state.epoch

    to_save = {
        "model": run.model,
        "optimizer": run.optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "early_stopping": early,
    }
    checkpoint = Checkpoint(folder, to_save, run.trainer, config=CONFIG, keep_last=None)
    checkpoint.attach()
    length = epoch_length(SIZE, BATCH, get_world_size())
    stop_at(run.trainer, length + stop_epoch_position)
    run.trainer.run(run.loader, max_epochs=3)
    return {
        **at_save,
        "saved": [str(p) for p in checkpoint.saved],
        "length": length,
        "model": {k: v.clone() for k, v in unwrap_model(run.model).state_dict().items()},
        "wrapped_keys": sorted(run.model.state_dict()),
        "optimizer_steps": [s["step"].clone() for s in run.optimizer.state_dict()["state"].values()],
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "early_stopping": early.state_dict(),
        "trainer": {
            k: v
            for k, v in run.trainer.state_dict().items()
            if k in ("iteration", "epoch_length", "max_epochs")
        },
    }


def require_empty_on_every_rank(folders: list[str]) -> list[str | None]:
    """``Checkpoint(require_empty=True)`` on each folder: the FileExistsError's message, or None."""
    run = build_parts()
    out: list[str | None] = []
    for folder in folders:
        try:
            Checkpoint(folder, {"model": run.model}, run.trainer, require_empty=True)
        except FileExistsError as err:
            out.append(str(err))
        else:
            out.append(None)
    return out


# --- sampler position -----------------------------------------------------------------------------


def loaded_around_a_resume(
    folder: str, *, stop: int, max_epochs: int, batch_size: int = BATCH
) -> dict[str, Any]:
    """Run B stopped after ``stop``, run B' resumed: the indices each loaded, per epoch."""
    b1 = build_run(folder, batch_size=batch_size)
    stop_at(b1.trainer, stop)
    b1.trainer.run(b1.loader, max_epochs=max_epochs)
    b2 = build_run(folder, batch_size=batch_size)
    b2.checkpoint.resume("auto")
    b2.trainer.run(b2.loader, max_epochs=max_epochs)
    return {
        "rank": get_rank(),
        "world_size": get_world_size(),
        "stopped": b1.trainer.state.iteration,
        "before": b1.per_epoch_loaded,
        "after": b2.per_epoch_loaded,
    }


# --- preemption -----------------------------------------------------------------------------------


def preempted_job(
    folder: str,
    report: str,
    *,
    signal_name: str,
    at: int,
    on_rank: int,
    max_epochs: int,
    exit: bool = True,
    **parts: Any,
) -> dict[str, Any]:
    """A job whose rank ``on_rank`` sends itself ``signal_name`` after iteration ``at``.

    As the run completes, before Preemption acts on it (exiting with ``exit=True``), each
    rank writes what it saw to ``<report>-rank<r>.pt``; without an exit it also returns it.
    """
    run = build_run(folder, **parts)
    sig = getattr(signal, signal_name)

    @run.trainer.on(Events.ITERATION_COMPLETED(once=at))
    def _signal(engine: Engine) -> None:
        if get_rank() == on_rank:
            os.kill(os.getpid(), sig)

    seen: dict[str, Any] = {}

    @run.trainer.on(Events.COMPLETED)  # after the Checkpoint's handlers, before Preemption's
    def _report(engine: Engine) -> None:
        seen.update(
            rank=get_rank(),
            iteration=engine.state.iteration,
            signalled=preemption.signalled,
            triggered=preemption.triggered,
            saved=[p.name for p in run.checkpoint.saved],
        )
        torch.save(seen, f"{report}-rank{get_rank()}.pt")

    preemption = Preemption(run.checkpoint, exit=exit)
    preemption.attach(run.trainer)
    run.trainer.run(run.loader, max_epochs=max_epochs)
    return seen


def resume_each(folders: list[str], reference: str, *, max_epochs: int, **parts: Any) -> dict[str, Any]:
    """An uninterrupted run in ``reference``, then a run resuming from each of ``folders``."""
    ref = build_run(reference, **parts)
    ref.trainer.run(ref.loader, max_epochs=max_epochs)
    out: dict[str, Any] = {"reference": flat_params(ref.model), "resumed": {}}
    for folder in folders:
        run = build_run(folder, **parts)
        resumed = run.checkpoint.resume("auto")
        run.trainer.run(run.loader, max_epochs=max_epochs)
        out["resumed"][folder] = {
            "params": flat_params(run.model),
            "from": meta_of(resumed),
            "iteration": run.trainer.state.iteration,
        }
    return out


def exit_versus_save(
    folder: str, marks: str, *, at: int, max_epochs: int, patience_s: float, **parts: Any
) -> dict[str, Any]:
    """Rank 1 signals itself after ``at``; the only checkpoint is the preemption's, and rank 0
    writes it only once rank 1 has left its run (or after ``patience_s``, if rank 1 never
    does). Rank 1 records which checkpoint files existed when its run ended, before exiting.
    """
    import time

    import unison.checkpoint.writer as writer_module

    rank1_left = Path(marks) / "rank1-left-its-run"
    real_save = writer_module.atomic_save

    def save_after_rank1_left(obj: Any, path: Any, **options: Any) -> Any:
        deadline = time.monotonic() + patience_s
        while not rank1_left.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_save(obj, path, **options)

    writer_module.atomic_save = save_after_rank1_left
    run = build_run(folder, checkpoint=dict(every_epochs=None, at_end=False), **parts)
    Preemption(run.checkpoint, exit=True).attach(run.trainer)

    @run.trainer.on(Events.ITERATION_COMPLETED(once=at))
    def _signal(engine: Engine) -> None:
        if get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        run.trainer.run(run.loader, max_epochs=max_epochs)
    except SystemExit:
        if get_rank() == 1:
            files = sorted(p.name for p in Path(folder).glob("*.pt"))
            torch.save({"files": files, "iteration": run.trainer.state.iteration}, Path(marks) / "rank1.pt")
            rank1_left.touch()
        raise
    return {}


# --- corners: rotation across layouts, non-finite weights ----------------------------------------


def train_saving(
    folder: str,
    *,
    max_epochs: int,
    resume: bool = False,
    checkpoint: dict[str, Any] | None = None,
    **parts: Any,
) -> dict[str, Any]:
    """Trains (resuming from ``folder`` first with ``resume``) and returns the files this run saved."""
    run = build_run(folder, checkpoint=checkpoint, **parts)
    resumed = run.checkpoint.resume("auto") if resume else None
    run.trainer.run(run.loader, max_epochs=max_epochs)
    return {
        "saved": [p.name for p in run.checkpoint.saved],
        "resumed": None if resumed is None else resumed.name,
        "iteration": run.trainer.state.iteration,
    }


# --- signals from outside the job -----------------------------------------------------------------

_HELD_LOCKS: list[Any] = []


def train_until_signalled(
    folder: str,
    marks: str,
    *,
    max_epochs: int,
    pace_s: float,
    preemption: bool = True,
    checkpoint: dict[str, Any] | None = None,
    **parts: Any,
) -> dict[str, Any]:
    """Trains slowly (``pace_s`` per iteration) until a signal from outside the job stops it.

    Each rank writes ``<marks>/rank<r>.pid`` (its pid) after its second iteration: training
    is under way. As the run completes, before Preemption acts on it, each rank writes what
    it saw to ``<marks>/report-rank<r>.pt``. Every rank holds a multiprocessing lock, a named
    semaphore in a spawned rank (as tqdm's lock is), which must not be reported leaked.
    """
    import multiprocessing
    import time

    _HELD_LOCKS.append(multiprocessing.RLock())
    run = build_run(folder, checkpoint=checkpoint, **parts)

    @run.trainer.on(Events.ITERATION_COMPLETED)
    def _pace(engine: Engine) -> None:
        time.sleep(pace_s)
        if engine.state.iteration == 2:
            final = Path(marks) / f"rank{get_rank()}.pid"
            partial = final.with_suffix(".part")
            partial.write_text(str(os.getpid()))
            os.replace(partial, final)

    seen: dict[str, Any] = {}

    @run.trainer.on(Events.COMPLETED)  # before Preemption's handler, attached below
    def _report(engine: Engine) -> None:
        seen.update(
            rank=get_rank(),
            iteration=engine.state.iteration,
            signalled=None if guard is None else guard.signalled,
            triggered=None if guard is None else guard.triggered,
            saved=[p.name for p in run.checkpoint.saved],
        )
        torch.save(seen, Path(marks) / f"report-rank{get_rank()}.pt")

    guard = Preemption(run.checkpoint) if preemption else None
    if guard is not None:
        guard.attach(run.trainer)
    run.trainer.run(run.loader, max_epochs=max_epochs)
    return seen
