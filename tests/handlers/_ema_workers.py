"""Rank functions of the EMA and LR-warmup resume tests (tests/handlers/test_ema.py, test_lr_scaling.py).

A run: an MLP with BatchNorm (buffers to average) under DDP above one rank, SGD with
momentum, a StepLR stepped per update, an :class:`~unison.handlers.LRWarmup`, an
:class:`~unison.handlers.EMA`, gradient accumulation, and a Checkpoint every few
iterations. :func:`resume_matches` trains it uninterrupted, then resumes a fresh build
from a checkpoint saved mid-epoch and inside the warmup, and returns both runs' EMA
states, effective learning rates and weights for the test to compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from unison.checkpoint import load_checkpoint
from unison.distributed import barrier, get_rank, prepare_loaders, prepare_model, unwrap_model
from unison.engine import Engine, UpdateEvents, create_trainer
from unison.handlers import EMA, Checkpoint, LRWarmup
from unison.utils import manual_seed

EPOCHS = 2


@dataclass
class EMARun:
    model: nn.Module
    trainer: Engine
    loader: Any
    ema: EMA
    checkpoint: Checkpoint
    lrs: list[float] = field(default_factory=list)
    """The learning rate of each optimizer step, as the optimizer used it (warmup included)."""


def build(folder: str, *, accumulation: int = 2, warmup_steps: int = 5) -> EMARun:
    """One rank's run, built from scratch as a fresh job builds it."""
    manual_seed(0)
    model = prepare_model(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(40, 6, generator=gen), torch.randint(0, 3, (40,), generator=gen))
    loader, _ = prepare_loaders(data, batch_size=4, seed=0, drop_last=True)
    trainer = create_trainer(model, optimizer, F.cross_entropy, accumulation_steps=accumulation, sync_every=1)
    trainer.add_event_handler(UpdateEvents.UPDATE_COMPLETED, lambda _: scheduler.step())
    LRWarmup(optimizer, warmup_steps).attach(trainer)
    ema = EMA(model, decay=0.7, warmup=1)
    ema.attach(trainer)
    checkpoint = Checkpoint(
        folder,
        {"model": model, "optimizer": optimizer, "scheduler": scheduler},
        trainer,
        every_iters=2,
        keep_last=None,
    )
    checkpoint.attach()
    run = EMARun(model, trainer, loader, ema, checkpoint)
    # registered after the warmup's pre-hook: sees the learning rate the step uses
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: run.lrs.append(opt.param_groups[0]["lr"]))
    return run


def _state(run: EMARun) -> dict[str, Any]:
    return {
        "ema": {k: v.clone() for k, v in run.ema.module.state_dict().items()},
        "ema_updates": run.ema.updates,
        "weights": {k: v.clone() for k, v in unwrap_model(run.model).state_dict().items()},
        "lrs": list(run.lrs),
    }


def resume_matches(folder: str, accumulation: int = 2) -> dict[str, Any]:
    """Collective: the uninterrupted run, and a run resumed from a mid-epoch save inside the warmup."""
    full = build(str(Path(folder) / "full"), accumulation=accumulation)
    full.trainer.run(full.loader, max_epochs=EPOCHS)
    epoch_length = full.trainer.state.epoch_length
    barrier()  # rank 0's files are written before any rank reads them
    saves = []
    for path in sorted((Path(folder) / "full").glob("*.pt")):
        meta = load_checkpoint(path)["meta"]
        saves.append((meta["iteration"], str(path)))
    iteration, chosen = min(s for s in saves if s[0] % epoch_length and s[0] > 2)
    resumed = build(str(Path(folder) / "resumed"), accumulation=accumulation)
    resumed.checkpoint.resume(chosen)
    update_at = resumed.trainer.state.update
    resumed.trainer.run(resumed.loader, max_epochs=EPOCHS)
    return {
        "rank": get_rank(),
        "iteration": iteration,
        "epoch_length": epoch_length,
        "update_at": update_at,
        "full": _state(full),
        "resumed": _state(resumed),
    }
