"""Rank function and driver of tests/distributed/test_clean_exit.py.

``train_and_record`` trains a small model as a recipe does (``prepare_model``'s DDP, an
engine with handlers, an evaluation) and registers an ``atexit`` handler that writes which
threads of a process group are still running when the interpreter starts its teardown:
``exit-<launch>-rank<r>.json`` in the output folder. Run as a script, this module is the
launching process: ``spawn N OUT`` launches N jobs of 2 spawned ranks one after the other;
``torchrun OUT``, started by torchrun, is one rank of a job whose group ``launch`` creates;
``fail`` launches a job whose rank 1 raises, and exits with 3 once launch has reported it.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

# The C++ threads of a process group: gloo's workers and socket loop, rank 0's TCPStore server.
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv", "pt_tcpstore")


def group_threads() -> list[str]:
    """Names of this process's threads that belong to a process group."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in GROUP_THREADS:
            names.append(name)
    return sorted(names)


def train_and_record(out: str, launch_id: int, strategy: str = "ddp") -> int:
    from unison.distributed import get_rank, prepare_loaders, prepare_model
    from unison.engine import Events, create_evaluator, create_trainer
    from unison.metrics import Accuracy, Loss

    rank = get_rank()
    path = Path(out) / f"exit-{launch_id}-rank{rank}.json"

    def record() -> None:  # runs as the interpreter starts its teardown
        path.write_text(json.dumps({"pid": os.getpid(), "group_threads": group_threads()}))

    atexit.register(record)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen))
    train_loader, val_loader = prepare_loaders(data, data, batch_size=8, seed=0)
    model = prepare_model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), strategy=strategy)
    clip = 1.0 if strategy == "fsdp" else None  # a global norm over shards: DTensor redistributions
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, clip_grad_norm=clip
    )
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)})
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(val_loader))
    trainer.run(train_loader, max_epochs=2)
    return trainer.state.iteration


def raise_on_rank_one() -> int:
    from unison.distributed import get_rank

    if get_rank() == 1:
        raise ValueError("rank one fails on purpose")
    return 0


def main(argv: list[str]) -> None:
    from unison.distributed import RankFailedError, launch

    mode, rest = argv[0], argv[1:]
    if mode == "spawn":
        runs, out = int(rest[0]), rest[1]
        for launch_id in range(runs):
            launch(train_and_record, out, launch_id, nproc_per_node=2, backend="gloo", start_method="spawn")
    elif mode == "spawn-fsdp":  # DTensor's caches hold the device mesh, and so the group
        launch(train_and_record, rest[0], 0, "fsdp", nproc_per_node=2, backend="gloo", start_method="spawn")
    elif mode == "torchrun":
        launch(train_and_record, rest[0], 0, backend="gloo")
    elif mode == "fail":
        try:
            launch(raise_on_rank_one, nproc_per_node=2, backend="gloo", start_method="spawn")
        except RankFailedError as err:
            print(f"RankFailedError of rank {err.rank}: {err}")
            raise SystemExit(3) from None
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
