"""unison/handlers/mlflow_store.py: the pieces of an MLflow store that need processes of their own."""

from __future__ import annotations

import multiprocessing
import queue
from pathlib import Path

import pytest
from _mlflow_store_workers import open_store

N_PROCESSES = 2
TIMEOUT_S = 240


@pytest.mark.slow  # each process imports MLflow: seconds
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_processes_opening_a_new_sqlite_store_at_once_all_succeed(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path.resolve() / 'store' / 'mlflow.db'}"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(N_PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=open_store, args=(uri, barrier, results)) for _ in range(N_PROCESSES)]
    for p in procs:
        p.start()
    outcomes: list[str] = []
    try:
        for _ in procs:
            outcomes.append(results.get(timeout=TIMEOUT_S))
    except queue.Empty:
        outcomes.append(f"no answer in time; exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()  # only the processes this test started, by their handle
                p.join(timeout=10)
    assert outcomes == ["ok"] * N_PROCESSES, outcomes
    assert (tmp_path / "store" / "mlflow.db.lock").is_file()
