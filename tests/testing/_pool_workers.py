"""Rank functions of tests/testing/test_pool.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

IMPORTED_IN = os.getpid()
"""The process that imported this module: the warm process, or a rank that imported it itself."""

CALLS: list[int] = []
"""Appended to by every call: a fresh process sees it empty."""


def where_am_i() -> dict:
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "parent": os.getppid(), "imported_in": IMPORTED_IN, "world": total.item()}


def append_and_count() -> int:
    CALLS.append(dist.get_rank())
    return len(CALLS)


def setting() -> dict:
    return {"cwd": os.getcwd(), "path0": sys.path[0], "threads": torch.get_num_threads()}


def record_pid_then(folder: str, what: str) -> None:
    """Writes this rank's process id to ``folder``, then sleeps, or kills the warm process."""
    final = Path(folder) / f"rank-{dist.get_rank()}.pid"
    partial = final.with_suffix(".part")  # renamed whole: a reader never sees it half written
    partial.write_text(str(os.getpid()))
    os.replace(partial, final)
    if what == "kill-parent" and dist.get_rank() == 1:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(300)


def hang_on_rank_one() -> int:
    if dist.get_rank() == 1:
        time.sleep(300)
    return dist.get_rank()


def parallel_matmul() -> float:
    torch.set_num_threads(2)  # OpenMP's team starts here, in the rank
    a = torch.ones(256, 256)
    return float((a @ a).sum())
