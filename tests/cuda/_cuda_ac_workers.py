"""Rank functions of tests/cuda/test_cuda_activation_ckpt.py: a residual MLP with dropout on
the GPU, trained under bf16 autocast with and without activation checkpointing."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unison.distributed import device, get_rank, prepare_model
from unison.distributed.fsdp import full_model_state


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def train(strategy: str, ac: Any, iterations: int, width: int, blocks: int, batch: int) -> dict[str, Any]:
    """One run: losses, whole weights on the CPU, and the peak memory of the steps after the first
    above what the weights, gradients and optimizer state hold."""
    torch.manual_seed(0)
    model = prepare_model(Net(width, blocks), strategy=strategy, activation_checkpointing=ac)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    here = device()
    torch.manual_seed(100 + get_rank())  # dropout's masks, the same in both runs
    losses = []
    base = peak = 0
    for it in range(iterations):
        if it == 1:  # gradients and the optimizer's state exist now: what follows is the step's own
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        gen = torch.Generator().manual_seed(1000 * it + get_rank())
        x = torch.randn(batch, width, generator=gen).to(here)
        y = torch.randint(0, 8, (batch,), generator=gen).to(here)
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    weights = {k: v.detach().float().cpu() for k, v in full_model_state(model).items()}
    return {"losses": losses, "weights": weights, "peak": peak}


def both(strategy: str, iterations: int, width: int, blocks: int, batch: int) -> dict[str, Any]:
    return {
        "plain": train(strategy, False, iterations, width, blocks, batch),
        "ac": train(strategy, "auto", iterations, width, blocks, batch),
    }
