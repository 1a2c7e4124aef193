"""Rank functions of the signal and early-exit tests of ``launch``.

Spawned ranks import this small module by name rather than the test modules.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from multiprocessing import util
from pathlib import Path

from unison.distributed import get_local_rank, get_rank, get_world_size

_held: list[object] = []


def exit_early_on_rank(rank: int) -> int:
    """Rank ``rank`` calls ``sys.exit(0)``; the others return their rank."""
    if get_rank() == rank:
        sys.exit(0)
    return get_rank()


def placement_and_job() -> dict[str, object]:
    """Where this rank was placed, and the SLURM job it can see."""
    return {
        "rank": get_rank(),
        "local_rank": get_local_rank(),
        "world_size": get_world_size(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }


def preempted_with_slow_teardown(marks: str) -> None:
    """Both ranks hold a multiprocessing lock (a named semaphore in a spawned rank, as tqdm's is) and
    exit with 75, as the ranks of a preempted job do; rank 0 takes a while to tear down, and rank 1
    exits only once rank 0 is tearing down."""
    _held.append(multiprocessing.RLock())
    tearing_down = Path(marks) / "rank0-tearing-down"
    if get_rank() == 0:

        def slow_teardown() -> None:  # runs before multiprocessing's own finalizers (priority 0)
            tearing_down.touch()
            time.sleep(2.0)

        util.Finalize(None, slow_teardown, exitpriority=100)
    else:
        deadline = time.monotonic() + 60
        while not tearing_down.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    raise SystemExit(75)
