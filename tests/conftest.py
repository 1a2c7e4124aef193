"""Hygiene for every test: no process group, environment or child process outlives a test."""

from __future__ import annotations

import multiprocessing
import os

import _warm_exec
import pytest
import torch
import torch.distributed as dist

# The programs tests start (`python -m unison run`, `unison tune`, torchrun, scripts) fork from
# a warm interpreter that has imported torch and unison (tests/_warm_exec.py says when not).
_warm_exec.install(dict(os.environ))

# Tests use tiny models; on a shared 2-core machine two compute threads per process only
# fight each other (a cross-entropy of 8x2 took 85x longer with 2 threads than with 1).
torch.set_num_threads(1)

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "UNISON_SPAWNED")


# Marks whose tests run only when the -m expression names them (pyproject.toml says what each holds).
_OPT_IN_MARKS = ("compile",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the tests of an opt-in mark unless ``-m`` names it (``pytest -m compile``), and
    runs the tests marked slow first.

    The slow tests hold about three quarters of the suite's time, in pieces of up to 40 s. Dealt
    out first, they run side by side on the workers while the many short tests wait, and the
    short ones even the workers out at the end; in file order, a 40 s test dealt out last can
    run alone while the other worker has nothing left. The order is the same in every worker
    (pytest-xdist requires it): a stable sort of the collected order."""
    expression = config.getoption("markexpr", "") or ""
    marks = [mark for mark in _OPT_IN_MARKS if mark not in expression]
    left_out = [item for item in items if any(item.get_closest_marker(mark) for mark in marks)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(left_out)
        items[:] = [item for item in items if item not in dropped]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _program_start(request: pytest.FixtureRequest):
    """A ``cold_process`` test's programs start as new interpreters; the others', warm."""
    cold = request.node.get_closest_marker("cold_process") is not None
    _warm_exec.set_cold(cold)
    yield
    _warm_exec.set_cold(False)


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


# The summaries of two parts of the suite. They live here, not in those folders' conftests:
# with pytest-xdist (`-n 2`) the controller, which prints the summary, loads only this one;
# the workers' reports reach it with their keywords and user properties.
IGNITE_SUMMARY_KEY = "ignite_suite"  # tests/ignite_suite/run_ignite_suite.py: SUMMARY_KEY
GPU_COMMAND = "python benchmarks/gpu.py"  # runs tests/cuda, then the benchmarks, on a GPU machine


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """ignite's own tests, as counted by the run of its suite; the CUDA tests not run here."""
    lines = [
        value
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if getattr(report, "when", "call") == "call"
        for key, value in getattr(report, "user_properties", [])
        if key == IGNITE_SUMMARY_KEY
    ]
    if lines:
        terminalreporter.section("ignite's own tests")
        for line in lines:
            terminalreporter.line(line)
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "cuda" in getattr(r, "keywords", {})]
    if skipped:
        terminalreporter.write_line(
            f"cuda tier: {len(skipped)} test(s) not run (no GPU, or too few): run `{GPU_COMMAND}` on a GPU "
            "machine (docs/benchmarks.md, 'On a GPU machine')."
        )
