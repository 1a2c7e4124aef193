"""A loader's workers start by fork on Linux, whatever start method started the rank.

A rank started by forkserver (or spawn) would otherwise start each worker the same way,
and every worker would import torch and the user's modules again at every epoch.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _worker_start_workers import worker_marks
from torch.utils.data import IterableDataset, TensorDataset

from unison.distributed import prepare_loaders, shard_stream
from unison.distributed.worker_start import worker_context
from unison.testing import run_distributed

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="fork is the default on Linux only"
)


@linux_only
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_workers_of_a_rank_started_by_forkserver_are_forked_from_it():
    for rank in run_distributed(worker_marks, nproc=2, start_method="forkserver", timeout=100):
        (pid,) = rank["pid"]
        assert rank["train"] == [pid] * 2 and rank["val"] == [pid] * 2, (
            f"a worker imported the test module anew (saw {rank}): it was not forked from its rank"
        )


@linux_only
def test_every_loader_unison_builds_forks_its_workers_unless_told_otherwise():
    data = TensorDataset(torch.arange(8.0))
    train, val = prepare_loaders(data, data, batch_size=2, num_workers=2)
    assert train.multiprocessing_context.get_start_method() == "fork"
    assert val.multiprocessing_context.get_start_method() == "fork"
    stream, _ = prepare_loaders(shard_stream(_Stream()), None, batch_size=2, num_workers=2)
    assert stream.multiprocessing_context.get_start_method() == "fork"
    chosen, _ = prepare_loaders(data, None, batch_size=2, num_workers=2, multiprocessing_context="spawn")
    assert chosen.multiprocessing_context.get_start_method() == "spawn", "the caller's choice is kept"
    inline, _ = prepare_loaders(data, None, batch_size=2)
    assert inline.multiprocessing_context is None, "no workers, no context"


def test_the_context_is_added_only_where_it_applies(monkeypatch):
    assert worker_context(0, {}) == {}
    assert worker_context(2, {"multiprocessing_context": "spawn"}) == {"multiprocessing_context": "spawn"}
    monkeypatch.setattr(sys, "platform", "darwin")
    assert worker_context(2, {"pin_memory": True}) == {"pin_memory": True}, "fork is unsafe on macOS"


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))
