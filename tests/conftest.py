"""Hygiene for every test: no process group, environment or child process outlives a test."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

# Tests use tiny models; on a shared 2-core machine two compute threads per process only
# fight each other (a cross-entropy of 8x2 took 85x longer with 2 threads than with 1).
torch.set_num_threads(1)

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "UNISON_SPAWNED")


# Marks whose tests run only when the -m expression names them (pyproject.toml says what each holds).
_OPT_IN_MARKS = ("compile",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the tests of an opt-in mark unless ``-m`` names it (``pytest -m compile``)."""
    expression = config.getoption("markexpr", "") or ""
    marks = [mark for mark in _OPT_IN_MARKS if mark not in expression]
    left_out = [item for item in items if any(item.get_closest_marker(mark) for mark in marks)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(left_out)
        items[:] = [item for item in items if item not in dropped]


@pytest.fixture(autouse=True)
def _clean_distributed_state():
    """Restores the environment, destroys a leaked process group, and fails on leftover children."""
    saved_env = dict(os.environ)
    for key in list(os.environ):
        if key in _LAUNCHER_VARS or key.startswith(("SLURM_", "TORCHELASTIC_")):
            os.environ.pop(key)
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        import ignite.distributed as idist

        idist.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)
    leftovers = [p for p in multiprocessing.active_children() if p.pid not in before]
    for proc in leftovers:
        proc.kill()
        proc.join(timeout=5)
    assert not leaked_group, "the test left a torch.distributed process group behind"
    assert not leftovers, f"the test left child processes running: {[p.pid for p in leftovers]}"
