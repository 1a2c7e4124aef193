"""Rank functions of tests/testing/test_pool.py."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from unison.distributed import prepare_model, rank_setup

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


def write_whole(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a rename: a reader never sees it half written."""
    partial = path.with_suffix(".part")
    partial.write_text(text)
    os.replace(partial, path)


def record_pid_then(folder: str, what: str) -> None:
    """Writes this rank's process id to ``folder``, then sleeps, or kills the warm process."""
    write_whole(Path(folder) / f"rank-{dist.get_rank()}.pid", str(os.getpid()))
    if what == "kill-parent":
        dist.barrier()  # every rank's file is written before the warm process (and so the ranks) dies
        if dist.get_rank() == 1:
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


def frozen_at_leave(folder: str) -> int:
    """The objects frozen now, and (in ``folder``) those still frozen as the rank collects its
    garbage before leaving its group: the warm process's, unless the leave unfroze them."""
    collect, path = gc.collect, Path(folder) / f"rank-{dist.get_rank()}.frozen"

    def recording(*args: int) -> int:
        write_whole(path, str(gc.get_freeze_count()))
        return collect(*args)

    gc.collect = recording  # this rank's own gc module: it exits after the leave
    return gc.get_freeze_count()


def sharded_then_group_threads(folder: str) -> float:
    """Trains an FSDP2 model with clipping (DTensor's caches then hold its device mesh, and the
    mesh the group) and records (in ``folder``) the group's threads still running after the leave."""
    threads, path = rank_setup._group_threads, Path(folder) / f"rank-{dist.get_rank()}.threads"

    def recording() -> list[str]:
        left = threads()
        write_whole(path, json.dumps(left))
        return left

    rank_setup._group_threads = recording
    model = prepare_model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a global norm: redistributions
    optimizer.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def group_settings() -> dict:
    """What this rank's process group is: its store's port, the timeouts of the group and of its
    store, torch's debug level, the backend's type (checked, or not, by torch's wrapper) and where
    ignite places the rank."""
    import ignite.distributed as idist
    from torch.distributed import distributed_c10d

    backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return {
        "pid": os.getpid(),
        "port": int(os.environ["MASTER_PORT"]),
        "group_timeout": backend.options._timeout.total_seconds(),
        "store_timeout": distributed_c10d._get_default_store().timeout.total_seconds(),
        "debug": str(dist.get_debug_level()),
        "backend": type(backend).__name__,
        "world": total.item(),
        "placement": (
            idist.get_local_rank(),
            idist.get_nproc_per_node(),
            idist.get_nnodes(),
            idist.get_node_rank(),
        ),
    }


def fail_as_it_leaves(folder: str) -> int:
    """Returns, then fails as it leaves its group (after the call has its results): rank 1 only."""
    write_whole(Path(folder) / f"rank-{dist.get_rank()}.pid", str(os.getpid()))
    if dist.get_rank() == 1:
        from unison.distributed import spawn

        def failing() -> None:
            raise RuntimeError("this rank's leave fails on purpose")

        spawn._leave_group = failing  # this rank's own module: it exits after the leave
    return dist.get_rank()
