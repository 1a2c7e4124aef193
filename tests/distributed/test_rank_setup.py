"""How a rank leaves its process group: the garbage that holds the group is collected while the
group is whole, and the group's threads end there."""

from __future__ import annotations

import gc
from datetime import timedelta
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
import torch.distributed as dist
from torch import nn

from unison.distributed.rank_setup import _group_threads, _leave_group

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="threads are read from /proc (Linux)"
)


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A one-rank gloo group in this process; each call to gc.collect records whether the group was
    still initialised then."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    assert idist.get_world_size() == 1  # ignite takes the group as its context, as in a rank
    collects: list[str] = []
    collect = gc.collect
    monkeypatch.setattr(
        gc,
        "collect",
        lambda *a: collects.append("whole" if dist.is_initialized() else "destroyed") or collect(*a),
    )
    return collects


class _Cycle:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.me = self  # only the garbage collector frees it


def test_a_model_in_a_reference_cycle_is_collected_and_the_groups_threads_end(group, caplog):
    cycle = _Cycle(nn.parallel.DistributedDataParallel(nn.Linear(2, 2)))
    cycle.model(torch.ones(1, 2)).sum().backward()
    del cycle
    _leave_group()
    assert _group_threads() == []
    assert group and group[0] == "whole", (
        f"gc.collect ran {group}: a model freed after its group was destroyed can wait on it for good"
    )
    assert "still run" not in caplog.text
