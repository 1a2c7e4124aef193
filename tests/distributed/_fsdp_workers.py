"""Rank functions of tests/distributed/test_fsdp.py: the same training under DDP and FSDP2.

Batches depend only on (iteration, rank), so two strategies at the same world size see
the same data; the model's whole weights come back from every rank as plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from _ddp_workers import batch, make_mlp
from torch import nn

from unison.distributed import get_rank, get_world_size, prepare_model
from unison.distributed.fsdp import full_model_state, is_sharded
from unison.engine import create_evaluator, create_trainer
from unison.engine.predict import predict
from unison.metrics import Accuracy, Loss


def train(strategy: str, iterations: int, **trainer_kwargs: Any) -> dict[str, torch.Tensor]:
    """Trains the MLP for ``iterations`` steps of this rank's batches; the whole weights after."""
    model = prepare_model(make_mlp(), strategy=strategy)
    assert is_sharded(model) == (strategy == "fsdp" and get_world_size() > 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy, **trainer_kwargs)
    trainer.run([batch(i, get_rank()) for i in range(iterations)], max_epochs=1)
    return {k: v.detach().clone() for k, v in full_model_state(model).items()}


def evaluate_uneven(strategy: str, samples: int) -> tuple[dict[str, float], torch.Tensor | None]:
    """Exact evaluation and prediction of ``samples`` rows, sharded without padding (uneven shards)."""
    from torch.utils.data import DataLoader, TensorDataset

    from unison.distributed import EvalSampler

    model = prepare_model(make_mlp(), strategy=strategy)
    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(
        torch.randn(samples, 8, generator=gen), torch.randint(0, 3, (samples,), generator=gen)
    )
    loader = DataLoader(data, batch_size=2, sampler=EvalSampler(data))
    evaluator = create_evaluator(model, {"acc": Accuracy(), "loss": Loss(nn.functional.cross_entropy)})
    metrics = dict(evaluator.run(loader).metrics)
    return metrics, predict(model, data, batch_size=2)


def ema_evaluated(strategy: str, iterations: int) -> tuple[float, float, float, float]:
    """Trains with an EMA, then evaluates the average with the evaluator. Returns the evaluator's
    loss, the loss of a plain model loaded with the average's whole weights and of one with the
    trained weights (both computed here on all the data), and how far the trained weights moved
    across the evaluation (the swap undone: 0)."""
    from torch.utils.data import DataLoader, TensorDataset

    from unison.distributed import EvalSampler
    from unison.distributed.fsdp import global_value
    from unison.handlers import EMA

    model = prepare_model(make_mlp(), strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    ema = EMA(model, decay=0.5)
    ema.attach(trainer)
    trainer.run([batch(i, get_rank()) for i in range(iterations)], max_epochs=1)
    gen = torch.Generator().manual_seed(11)
    data = TensorDataset(torch.randn(9, 8, generator=gen), torch.randint(0, 3, (9,), generator=gen))
    before = {k: v.clone() for k, v in full_model_state(model).items()}
    evaluator = create_evaluator(ema.module, {"loss": Loss(nn.functional.cross_entropy)})
    loss = evaluator.run(DataLoader(data, batch_size=2, sampler=EvalSampler(data))).metrics["loss"]
    after = full_model_state(model)
    moved = max(float((before[k] - after[k]).abs().max()) for k in before)
    if ema.shards is not None:
        weights = {k: global_value(v) for k, v in ema.shards.state().items()}
    else:
        weights = ema.module.state_dict()
    losses = []
    for state in (weights, before):
        plain = make_mlp()
        plain.load_state_dict(state)
        with torch.no_grad():
            losses.append(float(nn.functional.cross_entropy(plain(data.tensors[0]), data.tensors[1])))
    return loss, losses[0], losses[1], moved


class TwoLists(nn.Module):
    """Layers held in two ``ModuleList``s, as a graph network holds its convolutions and norms, or a
    transformer its encoder's and decoder's layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encode = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)])
        self.decode = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.encode, *self.decode][:-1]:
            x = torch.tanh(layer(x))
        return self.decode[-1](x)


def two_lists_trained(strategy: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Two steps of :class:`TwoLists` under ``strategy``; its whole weights after, and the classes of
    the modules FSDP2 made units (the root left out)."""
    from unison.distributed.fsdp import fsdp_units

    model = prepare_model(TwoLists(), strategy=strategy)
    units = [type(u).__name__ for u in fsdp_units(model)][1:] if strategy == "fsdp" else []
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, nn.functional.cross_entropy)
    trainer.run([batch(i, get_rank()) for i in range(2)], max_epochs=1)
    return {k: v.detach().clone() for k, v in full_model_state(model).items()}, units
