"""Rank functions of the tests in tests/distributed/.

``run_distributed`` sends a function by name; spawned ranks import this small module rather
than the test modules (which would import pytest in every rank). Each function computes on
its rank and returns plain data; the tests assert in the parent process.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _collective_probe import count_collectives
from torch.utils.data import Dataset, TensorDataset

from unison.distributed import (
    EvalSampler,
    TrainSampler,
    all_reduce_sum,
    broadcast_object,
    device,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    launch,
    prepare_loaders,
    rank_zero_only,
    split_dataset,
    sync_bool,
)
from unison.distributed.primitives import first_rank
from unison.engine import Engine, Events


class IndexDataset(Dataset):
    """Sample ``i`` is the integer ``i``: a batch tells which indices a rank drew."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


# --- samplers and loaders ---------------------------------------------------------------------------


def indices_seen_by_engine(size: int, batch_size: int, epochs: int, seed: int) -> dict[int, list[int]]:
    """Runs a unison Engine over ``prepare_loaders``' training loader; the indices of each epoch."""
    train_loader, _ = prepare_loaders(IndexDataset(size), batch_size=batch_size, seed=seed)
    seen: dict[int, list[int]] = {}
    engine = Engine(lambda engine, batch: batch.tolist())

    @engine.on(Events.ITERATION_COMPLETED)
    def record(engine: Engine) -> None:
        seen.setdefault(engine.state.epoch, []).extend(engine.state.output)

    engine.run(train_loader, max_epochs=epochs)
    return seen


def split_on_rank(size: int, fractions: list[float], seeds: list[int]) -> dict[int, list[list[int]]]:
    """``split_dataset`` after seeding torch's global RNG with the rank, for each seed."""
    torch.manual_seed(get_rank())
    dataset = list(range(size))
    out = {}
    for seed in seeds:
        subsets = split_dataset(dataset, fractions, seed=seed)
        out[seed] = [[subset[i] for i in range(len(subset))] for subset in subsets]
    return out


def loader_shapes(train_size: int, val_size: int, batch_size: int, val_batch_size: int | None) -> dict:
    """The batch sizes and samplers of this rank's loaders."""
    train = TensorDataset(torch.arange(train_size))
    val = TensorDataset(torch.arange(val_size))
    train_loader, val_loader = prepare_loaders(
        train, val, batch_size=batch_size, val_batch_size=val_batch_size, seed=3
    )
    assert train_loader is not None and val_loader is not None
    return {
        "train_batches": [len(batch) for (batch,) in train_loader],
        "val_batches": [len(batch) for (batch,) in val_loader],
        "val_indices": [i for (batch,) in val_loader for i in batch.tolist()],
        "train_sampler": (
            type(train_loader.sampler).__name__,
            train_loader.sampler.rank,
            train_loader.sampler.world_size,
        ),
        "val_sampler": (
            type(val_loader.sampler).__name__,
            val_loader.sampler.rank,
            val_loader.sampler.world_size,
        ),
    }


def default_placement() -> dict:
    """What the samplers take from the process group when rank and world size are left out."""
    train = TrainSampler(range(10))
    evaluation = EvalSampler(range(10))
    return {
        "train": (train.rank, train.world_size),
        "eval": (evaluation.rank, evaluation.world_size),
        "rank": get_rank(),
        "world_size": get_world_size(),
    }


# --- primitives -------------------------------------------------------------------------------------------


def rank_tensors(rank: int) -> list[torch.Tensor]:
    """Tensors of mixed sizes and dtypes whose values depend on the rank."""
    return [
        torch.arange(3, dtype=torch.float32) + 10 * rank,
        torch.tensor([rank**2 + 0.5], dtype=torch.float64),
        torch.arange(5, dtype=torch.int64) * (rank + 1),
    ]


def exercise_primitives(flag_patterns: list[list[bool]]) -> dict:
    rank, world_size = get_rank(), get_world_size()
    out: dict = {
        "placement": (rank, world_size, get_local_rank(), is_distributed(), str(device())),
        "sync_bool": [
            {mode: sync_bool(pattern[rank], mode) for mode in ("any", "all", "rank_zero")}
            for pattern in flag_patterns
        ],
        "broadcast": {
            src: broadcast_object({"from": rank, "payload": [rank] * 3}, src=src) for src in range(world_size)
        },
    }
    with count_collectives() as counted:
        out["first_rank"] = [first_rank(pattern[rank]) for pattern in flag_patterns]
    out["first_rank_calls"] = {name: n for name, n in counted.items() if n}

    calls: list[int] = []

    @rank_zero_only
    def side_effect(value: int) -> int:
        calls.append(value)
        return value * 2

    @rank_zero_only
    def failing() -> None:
        raise ValueError(f"raised on rank {get_rank()}")

    out["rank_zero_only"] = {"returned": side_effect(21), "calls": calls, "name": side_effect.__name__}
    try:
        failing()
        out["rank_zero_only"]["raised"] = None
    except ValueError as err:
        out["rank_zero_only"]["raised"] = str(err)

    with count_collectives() as counted:
        sums = all_reduce_sum(rank_tensors(rank))
        empty = all_reduce_sum([])
    out["all_reduce_sum"] = {
        "sums": [s.tolist() for s in sums],
        "dtypes": [str(s.dtype) for s in sums],
        "devices": [str(s.device) for s in sums],
        "empty": empty,
        "calls": dict(counted),
    }
    return out


# --- launch ----------------------------------------------------------------------------------------------


def placement(offset: int, *, scale: int = 1) -> dict:
    return {
        "rank": get_rank(),
        "world_size": get_world_size(),
        "local_rank": get_local_rank(),
        "value": scale * (offset + get_rank()),
        "pid": os.getpid(),
        "group": dist.is_available() and dist.is_initialized(),
    }


def sum_of_ranks(token: int) -> tuple[int, float, int]:
    """An all-reduce whose result tells every rank took part: sum of (token + rank); and the port."""
    t = torch.tensor([float(token + get_rank())])
    dist.all_reduce(t)
    return token, t.item(), int(os.environ["MASTER_PORT"])


def fail_on_rank_one_while_rank_zero_waits(message: str) -> None:
    if get_rank() == 1:
        raise ValueError(message)
    # Rank 0 blocks in a collective that rank 1 never joins: only the launcher can end it.
    dist.all_reduce(torch.zeros(1))


def sleep_past_deadline(seconds: float) -> None:
    time.sleep(seconds)


def nested_launch() -> None:
    launch(placement, 0, nproc_per_node=2)


def process_group_timeout() -> float | None:
    """The timeout of the default process group, read from its gloo backend's options."""
    group = dist.group.WORLD
    try:
        backend = group._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def mismatched_all_reduce() -> None:
    """Rank 1 all-reduces a longer tensor than rank 0: gloo aborts the process."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(2 + 3 * dist.get_rank()))


def rank_one_skips_a_collective() -> None:
    """Rank 1 returns while rank 0 still calls a collective."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))


def parent_and_threads() -> tuple[int, int]:
    """This rank's parent process and torch's intra-op thread count."""
    return os.getppid(), torch.get_num_threads()
