"""Rank functions of tests/distributed/test_activation_ckpt_buffers.py: a residual MLP whose
blocks hold BatchNorm (and dropout), trained with and without activation checkpointing.

Batches depend only on (iteration, rank) and each run seeds its dropout from the rank, so both
runs see the same data and draw the same masks; the evaluation set is the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unison.distributed import get_rank, prepare_model
from unison.distributed.fsdp import full_model_state

WIDTH = 8


class NormBlock(nn.Module):
    """x + dropout(relu(batchnorm(linear(x)))): BatchNorm updates its running statistics in forward."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.norm(self.linear(x))))


class NormNet(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, WIDTH), nn.Linear(WIDTH, 3)
        self.blocks = nn.Sequential(NormBlock(dropout), NormBlock(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def batch(iteration: int, rank: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    x = torch.randn(rows, 4, generator=gen) * 3 + 1  # far from BatchNorm's initial statistics
    return x, (x[:, 0] > x[:, 1]).long() + (x[:, 2] > 2).long()


def train(ac: Any, iterations: int, dropout: float, strategy: str = "ddp") -> dict[str, Any]:
    """A run of ``iterations`` steps: its whole state (weights and buffers) and its evaluation."""
    torch.manual_seed(7)
    model = NormNet(dropout)
    torch.manual_seed(100 + get_rank())  # dropout's masks
    model = prepare_model(model, strategy=strategy, activation_checkpointing=ac)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for it in range(iterations):
        x, y = batch(it, get_rank())
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    x, y = batch(-1, 0, rows=48)
    with torch.no_grad():
        logits = model(x)
    return {
        "state": {k: v.detach().clone() for k, v in full_model_state(model).items()},
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "loss": float(nn.functional.cross_entropy(logits, y)),
    }


def both(iterations: int, dropout: float, strategy: str = "ddp") -> dict[str, Any]:
    """The plain run and the checkpointed one, on this rank."""
    return {
        "plain": train(False, iterations, dropout, strategy),
        "ac": train("auto", iterations, dropout, strategy),
    }
