"""Rank functions of tests/distributed/test_activation_ckpt.py: a residual MLP with dropout,
trained with and without activation checkpointing, under DDP and FSDP2.

Batches depend only on (iteration, rank) and each run seeds its dropout from the rank, so a
run with checkpointed blocks and one without see the same data and draw the same masks.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from unison.distributed import get_rank, prepare_model, unwrap_model
from unison.distributed.fsdp import full_model_state

WIDTH = 16


class Block(nn.Module):
    """x + dropout(tanh(linear(x))); counts its forward calls (recomputations included)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(torch.tanh(self.linear(x)))


class QuietBlock(Block):
    """A Block that counts nothing: a compiled graph may not change Python state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 3, block: type[Block] = Block) -> None:
        super().__init__()
        self.stem = nn.Linear(8, WIDTH)
        self.blocks = nn.Sequential(*[block() for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def make_net(seed: int = 0, block: type[Block] = Block) -> Net:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    net = Net(block=block)
    torch.random.set_rng_state(state)
    return net


def batch(iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, start: int, stop: int) -> list[float]:
    """Iterations ``start .. stop - 1``; their losses."""
    losses = []
    for it in range(start, stop):
        x, y = batch(it, get_rank())
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fresh(strategy: str, ac: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = prepare_model(make_net(), strategy=strategy, activation_checkpointing=ac)  # type: ignore[arg-type]
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def block_calls(model: nn.Module) -> list[int]:
    return [m.calls for m in unwrap_model(model).modules() if isinstance(m, Block)]


def run(strategy: str, ac: Any, iterations: int) -> dict[str, Any]:
    """One training run: its losses, whole weights (plain keys), and forward calls per block."""
    torch.manual_seed(100 + get_rank())  # dropout's masks
    model, optimizer = fresh(strategy, ac)
    losses = steps(model, optimizer, 0, iterations)
    weights = {k: v.detach().clone() for k, v in full_model_state(model).items()}
    return {"losses": losses, "weights": weights, "calls": block_calls(model)}


def resumed(ac: Any, stop: int, total: int) -> dict[str, torch.Tensor]:
    """A DDP run saved after ``stop`` iterations (model, optimizer, RNG, through ``torch.save``),
    resumed in a fresh model and trained to ``total``: its whole weights."""
    torch.manual_seed(100 + get_rank())
    model, optimizer = fresh("ddp", ac)
    steps(model, optimizer, 0, stop)
    buffer = io.BytesIO()
    torch.save(
        {
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": torch.random.get_rng_state(),
        },
        buffer,
    )
    del model, optimizer
    torch.manual_seed(12345)  # whatever the RNG holds now, the saved state wins
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model, optimizer = fresh("ddp", ac)
    unwrap_model(model).load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.random.set_rng_state(saved["rng"])
    steps(model, optimizer, stop, total)
    return {k: v.detach().clone() for k, v in full_model_state(model).items()}


def scenarios(iterations: int, stop: int) -> dict[str, Any]:
    """Every comparison of the test on this rank: plain and checkpointed runs under DDP and
    FSDP2, and the checkpointed DDP run resumed at ``stop``."""
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        out[strategy] = {"plain": run(strategy, False, iterations), "ac": run(strategy, "auto", iterations)}
    out["resumed"] = resumed("auto", stop, iterations)
    return out
