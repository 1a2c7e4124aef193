"""How a loader's worker processes start: by fork where the platform allows it.

A rank that :func:`~unison.distributed.launch` (or :func:`~unison.testing.run_distributed`)
started by spawn or forkserver hands that start method on to its DataLoaders, and each of
their workers then imports torch, the user's modules and the dataset's from nothing: seconds
per worker, paid again at every epoch and every evaluation, since a loader starts new workers
each time it is iterated. Under torchrun the same ranks fork their workers, as a Linux
process does by default. :func:`worker_context` gives every loader unison builds that
default wherever it runs: workers forked from the rank, which has everything imported.

Forking a rank is what torch's DataLoader does by default on Linux; its workers must not
use CUDA or the process group, as under torchrun. Elsewhere (macOS, Windows) fork is unsafe
or absent, and the loader keeps Python's default. A ``multiprocessing_context`` passed in
the loader's keyword arguments is the user's choice and always wins.
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any


def worker_context(num_workers: int, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``loader_kwargs`` with ``multiprocessing_context="fork"`` added where it applies: worker
    processes, on Linux, and no context chosen by the caller."""
    if (
        num_workers > 0
        and sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and loader_kwargs.get("multiprocessing_context") is None
    ):
        return {**loader_kwargs, "multiprocessing_context": "fork"}
    return loader_kwargs
