"""A training run with a WandbLogger whose job is killed as a whole (the training process and W&B's
service with it, as a preemption or an out-of-memory kill does) right after a row was handed to
W&B and before W&B wrote it; then the run resumed from its checkpoint. Run as
``python _wandb_kill.py FOLDER killed|resumed``.

``killed``: 3 iterations an epoch. W&B writes a step's row once a later step arrives (a step's
row stays open to more values until then), so at epoch 3's end, once its row is handed over and
epoch 2's is in W&B's file, epoch 3's is not: W&B's service and this process are then killed
(SIGKILL); the last step written is printed. ``resumed``: from the checkpoint of epoch 2 (as if
the kill came before epoch 3's checkpoint was saved), on to epoch 4.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from _wandb_workers import offline_env
from torch.nn import functional as F

from unison.engine import create_trainer
from unison.handlers.wandb import WandbLogger
from unison.handlers.wandb_files import last_written_step

ITERS = 3
FLUSH_S = 0.2


def _service() -> int:
    """The pid of W&B's service process, a child of this one."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            name = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and name.startswith("wandb-core"):
            return int(stat.parent.name)
    raise RuntimeError("no W&B service process")


def _wait(until, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def main(folder: Path, phase: str) -> None:
    os.environ.update(offline_env(folder))
    # W&B writes what it holds to the run's file every 15 s by default; the wait for epoch 2's
    # row would be that long. A row still open (epoch 3's) is not written by a flush.
    os.environ["WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"] = str(FLUSH_S)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    data = [(torch.ones(4, 2) * i, torch.zeros(4, 1)) for i in range(ITERS)]
    if phase == "resumed":  # as the checkpoint taken at epoch 2's end restores it
        trainer.load_state_dict({"iteration": 2 * ITERS, "epoch_length": ITERS, "max_epochs": 4})
    logger = WandbLogger(
        "unison-tests", trainer=trainer, directory=folder, run_file=folder / "wandb-run.json"
    )
    logger.attach()
    if phase == "killed":
        wandb_dir = folder / "wandb"

        def kill_all(engine) -> None:
            if engine.state.epoch == 3:
                _wait(lambda: logger._writer is not None and logger._writer.last_step >= 3 * ITERS, "handed")
                _wait(lambda: last_written_step(wandb_dir, str(logger.run_id))[0] >= 2 * ITERS, "written")
                print("written", last_written_step(wandb_dir, str(logger.run_id))[0], flush=True)
                os.kill(_service(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.after_epoch(kill_all)
    trainer.run(data, max_epochs=4)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
