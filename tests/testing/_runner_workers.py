"""Rank functions of tests/testing/test_runner.py (a small module, so ranks need not import pytest)."""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from unison.distributed import get_rank, get_world_size


def rank_and_args(*args: object, **kwargs: object) -> dict:
    """This rank's place, and what it was called with."""
    total = torch.tensor([float(get_rank())])
    dist.all_reduce(total)
    return {
        "rank": get_rank(),
        "world_size": get_world_size(),
        "sum_of_ranks": total.item(),
        "args": args,
        "kwargs": kwargs,
        "tensor": torch.full((2,), float(get_rank())),
    }


def raise_on_rank(rank: int, message: str) -> int:
    if get_rank() == rank:
        raise ValueError(message)
    return get_rank()


def return_unpicklable() -> object:
    return threading.Lock()


def exit_abruptly(code: int) -> None:
    if get_rank() == 1:
        os._exit(code)


def killed_by_signal() -> None:
    if get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def read_environment(name: str) -> str | None:
    return os.environ.get(name)
