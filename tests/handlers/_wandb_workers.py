"""A tiny training run with a WandbLogger (offline, in ``folder``), on one rank or on every rank
of run_distributed; and the rows of an offline W&B run, read back with W&B's own reader.

Each rank trains its own Linear model on its own data (so the ranks' losses differ) and
returns what its engines saw: every iteration's loss, each epoch's agreed loss and
validation value, and whether this process ever imported W&B.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from unison.distributed import get_rank, get_world_size
from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers.wandb import WandbLogger
from unison.metrics import MeanSquaredError

N_SAMPLES, BATCH = 24, 4
ITERS = N_SAMPLES // BATCH  # per epoch
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def offline_env(folder: Path) -> dict[str, str]:
    """W&B kept off the network and out of the user's own files."""
    return {**OFFLINE, "WANDB_DIR": str(folder), "WANDB_CONFIG_DIR": str(folder / "config"),
            "WANDB_CACHE_DIR": str(folder / "cache"), "WANDB_DATA_DIR": str(folder / "data")}  # fmt: skip


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(N_SAMPLES, 3, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, N_SAMPLES, BATCH)]


def train(
    folder: str, *, epochs: int = 2, sync_every: int | None = None, **logger_kwargs: Any
) -> dict[str, Any]:
    """Trains ``epochs`` epochs with a WandbLogger attached (offline, into ``folder``); returns
    what the engines saw."""
    os.environ.update(offline_env(Path(folder)))
    rank = get_rank()
    data = batches(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), F.mse_loss, sync_every=sync_every
    )
    evaluator = create_evaluator(model, {"mse": MeanSquaredError()})
    seen: dict[str, Any] = {"losses": [], "epoch_loss": [], "val": [], "epoch_end": []}
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen["losses"].append(float(e.state.output))
    )

    def validate(engine: Engine) -> None:
        evaluator.run(data[:2])
        seen["epoch_loss"].append(engine.state.metrics["loss"])
        seen["val"].append(evaluator.state.metrics["mse"])
        seen["epoch_end"].append(engine.state.iteration)

    trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)
    logger_kwargs.setdefault("directory", folder)
    logger = WandbLogger("unison-tests", trainer=trainer, evaluators={"val": evaluator}, **logger_kwargs)
    logger.attach(trainer)
    trainer.run(data, max_epochs=epochs)
    seen.update(rank=rank, world_size=get_world_size(), run_id=logger.run_id, imported="wandb" in sys.modules)
    return seen


def run_files(folder: Path) -> list[Path]:
    """The ``.wandb`` file of every offline run under ``folder``, oldest first."""
    return sorted(Path(folder).rglob("offline-run-*/run-*.wandb"))


def records(run_file: Path) -> list[dict[str, Any]]:
    """Every record of an offline run's ``.wandb`` file, as W&B's own reader prints them
    (``wandb leet inspect --json``)."""
    env = {**os.environ, **offline_env(run_file.parents[2])}
    cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(cli), "leet", "inspect", "--json", str(run_file)],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def history(found: Path | list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step -> the row W&B holds at that step (``wandb.log`` calls merged as W&B merges them), of
    a ``.wandb`` file or of its :func:`records`."""
    rows: dict[int, dict[str, Any]] = {}
    for record in records(found) if isinstance(found, Path) else found:
        if record["type"] == "history":
            item = record["history"]
            step = int(item.get("step", {}).get("num", 0))
            rows.setdefault(step, {}).update({k: v for k, v in item["item"].items() if not k.startswith("_")})
    return rows
