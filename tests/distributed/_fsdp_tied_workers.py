"""Rank functions of tests/distributed/test_fsdp_tied.py: a tiny language model whose output
projection is its embedding (tied weights), trained under DDP or FSDP2 with sharded checkpoints,
stopped after a given iteration and resumed.
"""

from __future__ import annotations

from typing import Any

import torch
from ignite.engine import Events
from torch import nn
from torch.utils.data import TensorDataset

from unison.distributed import prepare_loaders, prepare_model, unwrap_model
from unison.distributed.fsdp import full_model_state
from unison.engine import create_trainer
from unison.handlers import Checkpoint

VOCAB, WIDTH, LENGTH, SAMPLES = 11, 8, 5, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class TiedLM(nn.Module):
    """Embedding, two blocks, a head Linear, and the output projection tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, WIDTH)
        self.decoder = nn.Linear(WIDTH, VOCAB, bias=False)
        self.decoder.weight = self.encoder.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.head(self.blocks(self.encoder(tokens))))).flatten(0, 1)


def make_lm() -> TiedLM:
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    lm = TiedLM()
    torch.random.set_rng_state(state)
    return lm


def corpus() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets.flatten())


def job(
    folder: str, strategy: str, epochs: int, *, stop_after: int | None = None, resume: bool = False
) -> Any:
    """Trains (or resumes and trains) until ``epochs`` or ``stop_after`` iterations in all: the whole
    weights after, and whether the model's two modules still share one parameter."""
    model = prepare_model(make_lm(), strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader, _ = prepare_loaders(corpus(), None, batch_size=2, seed=5)
    trainer = create_trainer(model, optimizer, next_token_loss, sync_every=1)
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, every_iters=2)
    checkpoint.attach()

    @trainer.on(Events.ITERATION_COMPLETED)
    def _stop(engine: Any) -> None:
        if stop_after is not None and engine.state.iteration == stop_after:
            engine.terminate()  # every rank at the same iteration

    if resume:
        checkpoint.resume("auto")
    trainer.run(loader, max_epochs=epochs)
    inner = unwrap_model(model)
    weights = {k: v.detach().clone() for k, v in full_model_state(model).items()}
    return weights, inner.decoder.weight is inner.encoder.weight, trainer.state.iteration
