"""What ``logging.wandb`` costs rank 0's training thread, offline (no network, no login).

A small trainer (Linear(3, 1), 24 iterations an epoch, a validation of 2 batches) runs
``--epochs`` epochs, with a :class:`~unison.handlers.wandb.WandbLogger` and without one, the
runs interleaved ``--repeats`` times. Reported, medians over the repeats:

    in the handler      time the training thread spends inside the logger's event handlers
                        per epoch (its own code, and the waits for the interpreter's lock
                        while the writer thread runs ``wandb.log``)
    per epoch, +logger  wall time per epoch with the logger minus without it
    open / end          ``wandb.init`` at the trainer's STARTED (once a job), and the run's end
    writer per batch    the writer thread's time per epoch batch (``wandb.log``), off training

    python benchmarks/wandb_cost.py                 # ~1 min on 2 busy CPU cores
    python benchmarks/wandb_cost.py --every 8       # with loss points at sync points
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers.wandb import WandbLogger
from unison.handlers.wandb_writer import RunWriter
from unison.metrics import MeanSquaredError

TIMED = ("_epoch_started", "_epoch_completed", "_evaluation_completed", "_epoch_done", "load_synced_state")


class TimedLogger(WandbLogger):
    """A WandbLogger that adds up the time its event handlers take on the training thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spent = 0.0
        self.opened = self.ended = 0.0
        for name in TIMED:
            setattr(self, name, self._timed(getattr(self, name)))

    def _timed(self, handler: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return handler(*args)
            finally:
                self.spent += time.perf_counter() - start

        return timed

    def _started(self, engine: Engine) -> None:
        start = time.perf_counter()
        super()._started(engine)
        self.opened = time.perf_counter() - start

    def _completed(self, engine: Engine) -> None:
        start = time.perf_counter()
        super()._completed(engine)
        self.ended = time.perf_counter() - start


def one_run(folder: Path | None, epochs: int, every: int | None) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, generator=gen)
    data = [(x[i : i + 4], x[i : i + 4].sum(1, keepdim=True)) for i in range(0, 96, 4)]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), F.mse_loss, sync_every=4)
    evaluator = create_evaluator(model, {"mse": MeanSquaredError()})
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(data[:2]))
    logger = None
    if folder is not None:
        config = {f"section.key{i}": i for i in range(150)}  # about the size of a resolved config
        logger = TimedLogger(
            "cost",
            trainer=trainer,
            evaluators={"val": evaluator},
            directory=folder,
            every=every,
            config=config,
        )
        logger.attach()
    trainer.run(data, max_epochs=1)  # warm up (and, with the logger, open the run: a cost of its own)
    start = time.perf_counter()
    trainer.run(data, max_epochs=epochs)
    wall = (time.perf_counter() - start) / epochs
    if logger is None:
        return {"epoch": wall}
    return {"epoch": wall, "handler": logger.spent / (epochs + 1), "open": logger.opened, "end": logger.ended}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="wandb-cost-"))
    os.environ.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(folder),
        WANDB_CONFIG_DIR=str(folder / "config"),
    )
    writes: list[float] = []
    original = RunWriter._write

    def timed_write(self: RunWriter, points: Any) -> None:
        start = time.perf_counter()
        original(self, points)
        writes.append(time.perf_counter() - start)

    RunWriter._write = timed_write  # type: ignore[method-assign]
    bare, logged = [], []
    for _ in range(args.repeats):
        bare.append(one_run(None, args.epochs, args.every))
        logged.append(one_run(folder, args.epochs, args.every))

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"{args.epochs} epochs of 24 iterations, every={args.every}, {args.repeats} repeats (medians)")
    print(f"  in the handler       {med(logged, 'handler') * 1e3:8.3f} ms an epoch")
    print(f"  per epoch, +logger   {(med(logged, 'epoch') - med(bare, 'epoch')) * 1e3:8.3f} ms "
          f"(bare {med(bare, 'epoch') * 1e3:.2f} ms)")  # fmt: skip
    print(f"  open / end           {med(logged, 'open'):8.2f} s / {med(logged, 'end') * 1e3:.0f} ms")
    print(f"  writer per batch     {statistics.median(writes) * 1e3:8.3f} ms (off the training thread)")


if __name__ == "__main__":
    main()
