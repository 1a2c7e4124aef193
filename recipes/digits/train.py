"""Handwritten digits: a small CNN on the 8x8 digits bundled with scikit-learn.

1,797 grey-scale images of the digits 0-9 (no download), 80 % for training and 20 % for
validation, split the same way on every rank. After each epoch the whole validation set
is evaluated exactly, each sample once across all ranks, and rank 0 logs one line.

The same file runs three ways:

    python recipes/digits/train.py --ranks 2                  # spawns 2 local ranks
    torchrun --nproc_per_node=2 recipes/digits/train.py       # torchrun starts the ranks
    python recipes/digits/train.py                            # one process, no process group

``--batch-size`` is per rank: with 2 ranks an optimizer step sees twice as many samples.
``--out metrics.json`` makes rank 0 write the final metrics as JSON, with the seconds rank 0
spent from loading the data to the end of training.

``config.yaml`` beside this file describes a variant in YAML, with checkpoints, early
stopping and a test split: ``unison run recipes/digits/config.yaml --nproc 2``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from digits import SmallCNN, load_all  # this recipe's data and model, next to this file

from unison import Events, create_evaluator, create_trainer, launch, prepare_loaders, prepare_model
from unison.distributed import get_world_size, rank_zero_only, split_dataset
from unison.handlers import ProgressBar
from unison.metrics import Accuracy, Loss
from unison.utils import get_logger, manual_seed

log = get_logger("digits")


def train(args: argparse.Namespace) -> dict[str, float | int]:
    """Runs on every rank: builds data, model and engines, trains, and returns the final metrics."""
    started = time.perf_counter()
    torch.set_num_threads(1)  # the model is tiny: more threads per rank only wait on each other
    manual_seed(args.seed)

    train_set, val_set = split_dataset(load_all(), [0.8, 0.2], seed=args.seed)
    train_loader, val_loader = prepare_loaders(train_set, val_set, batch_size=args.batch_size, seed=args.seed)

    model = prepare_model(SmallCNN())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = create_trainer(model, optimizer, F.cross_entropy)
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)})
    if not args.no_progress:
        ProgressBar().attach(trainer)

    @trainer.on(Events.EPOCH_COMPLETED)
    def validate(engine):  # every rank evaluates its shard: the metrics' sync is a collective
        val = evaluator.run(val_loader).metrics
        log.info(
            f"epoch {engine.state.epoch}/{engine.state.max_epochs}  "
            f"train loss {engine.state.metrics['loss']:.4f}  val loss {val['loss']:.4f}  "
            f"val accuracy {val['accuracy']:.4f} ({len(val_set)} samples)"
        )

    trainer.run(train_loader, max_epochs=args.epochs, epoch_length=args.epoch_length)

    summary = {
        "val_accuracy": evaluator.state.metrics["accuracy"],
        "val_loss": evaluator.state.metrics["loss"],
        "train_loss": trainer.state.metrics["loss"],
        "epochs": trainer.state.epoch,
        "iterations": trainer.state.iteration,
        "world_size": get_world_size(),
        "batch_size_per_rank": args.batch_size,
        "seed": args.seed,
        "wall_time_s": round(time.perf_counter() - started, 3),
    }
    if args.out:
        write_json(summary, args.out)
    return summary


@rank_zero_only
def write_json(summary: dict[str, float | int], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Not --nproc: torchrun reads any --nproc* option as its own --nproc-per-node, even after the script.
    parser.add_argument("--ranks", type=int, help="ranks to spawn here; leave out under torchrun or srun")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch-length", type=int, help="iterations per epoch (default: the whole shard)")
    parser.add_argument("--no-progress", action="store_true", help="draw no progress bar")
    parser.add_argument("--out", help="rank 0 writes the final metrics to this JSON file")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    launch(train, args, nproc_per_node=args.ranks)
