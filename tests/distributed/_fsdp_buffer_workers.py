"""Rank functions of tests/distributed/test_fsdp_buffers.py.

A small network with BatchNorm trained under FSDP2, with an EMA of its weights validated
at every epoch's end and sharded checkpoints every few iterations. Each rank trains on its
own samples, so each rank's running statistics follow different batches. A run reports
every rank's model state (parameters and buffers), its average, and the buffers the
validation ran with; :func:`phase_buffers` loads a checkpoint as the test phase does and reports
the buffers the test ran with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import TensorDataset

from unison.checkpoint import load_checkpoint
from unison.checkpoint.loading import load_states
from unison.distributed import get_rank, prepare_loaders, prepare_model
from unison.distributed.fsdp import full_model_state, global_value
from unison.engine import Engine, create_evaluator, create_trainer
from unison.handlers import EMA, Checkpoint
from unison.metrics import Accuracy

SAMPLES = 24
BATCH = 2


def make_net() -> nn.Module:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 3),
    )
    torch.random.set_rng_state(gen_state)
    return net


def datasets() -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 4, generator=gen) * torch.linspace(0.5, 4.0, SAMPLES).unsqueeze(
        1
    )  # scales differ
    val = torch.randn(10, 4, generator=gen)
    return (
        TensorDataset(x, torch.randint(0, 3, (SAMPLES,), generator=gen)),
        TensorDataset(val, torch.randint(0, 3, (10,), generator=gen)),
    )


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _validate_with(average: nn.Module, model: nn.Module, seen: list[dict[str, torch.Tensor]]) -> Engine:
    """An evaluator of ``average`` that records the buffers its forward passes see (``model``'s, with
    the average swapped in)."""
    evaluator = create_evaluator(average, {"acc": Accuracy()})
    evaluator.add_event_handler(Events.ITERATION_STARTED(once=1), lambda _: seen.append(_buffers(model)))
    return evaluator


def job(folder: str, epochs: int, *, stop_after: int | None = None, resume: bool = False) -> dict[str, Any]:
    """Trains (or resumes and trains) until ``epochs`` or until ``stop_after`` iterations in all."""
    model = prepare_model(make_net(), strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train, val = datasets()
    loader, val_loader = prepare_loaders(train, val, batch_size=BATCH, seed=5)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy, sync_every=1)
    ema = EMA(model, decay=0.8)
    ema.attach(trainer)
    validated: list[dict[str, torch.Tensor]] = []
    evaluator = _validate_with(ema.module, model, validated)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(val_loader))
    checkpoint = Checkpoint(
        folder, {"model": model, "optimizer": optimizer}, trainer, every_iters=4, keep_last=2
    )
    checkpoint.attach()

    before_saving: dict[str, torch.Tensor] = {}
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED(once=3), lambda _: before_saving.update(_buffers(model))
    )

    @trainer.on(Events.ITERATION_COMPLETED)
    def _stop(engine: Any) -> None:
        if stop_after is not None and engine.state.iteration == stop_after:
            engine.terminate()  # every rank at the same iteration

    if resume:
        checkpoint.resume("auto")
    trainer.run(loader, max_epochs=epochs)
    assert ema.shards is not None
    return {
        "rank": get_rank(),
        "state": {k: v.clone() for k, v in full_model_state(model).items()},
        "ema": {k: global_value(v).clone() for k, v in ema.shards.state().items()},
        "validated": validated,
        "before_saving": before_saving,
        "iteration": trainer.state.iteration,
    }


def phase_buffers(path: str) -> dict[str, torch.Tensor]:
    """The test phase: a fresh model and average load the checkpoint ``path`` (as ``unison run`` does
    for ``testing.use_best``); returns the buffers the test's forward passes see."""
    model = prepare_model(make_net(), strategy="fsdp")
    ema = EMA(model, decay=0.8)
    _, val_loader = prepare_loaders(None, datasets()[1], batch_size=BATCH)
    load_states({"model": model, "handler:EMA": ema}, load_checkpoint(path), Path(path), {"model": model})
    seen: list[dict[str, torch.Tensor]] = []
    _validate_with(ema.module, model, seen).run(val_loader)
    return seen[0]


def agree_nested() -> dict[str, Any]:
    """Each rank's own values in a nested state (floats, an integer, a flag, a shard), then agreed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from unison.distributed.replicated import agree_replicated

    rank = get_rank()
    mesh = init_device_mesh("cpu", (2,))
    shard = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Shard(0)])
    counter = torch.tensor(10 + rank)
    state = {
        "mean": torch.full((3,), float(rank) + 0.5),
        "more": [counter, (torch.tensor([rank == 1, True]), torch.empty(0))],
        "again": counter,  # the same tensor twice: broadcast once
        "shard": shard,
        "lr": 0.1 * (rank + 1),
    }
    count = agree_replicated(state)
    return {
        "count": count,
        "mean": state["mean"],
        "counter": counter,
        "flag": state["more"][1][0],
        "shard": shard.to_local().clone(),
        "lr": state["lr"],
    }
