"""Processes that open one new MLflow SQLite store at the same moment."""

from __future__ import annotations

from typing import Any


def open_store(uri: str, barrier: Any, results: Any) -> None:
    """Imports MLflow first (slow), waits for the others, then opens the store; puts
    ``"ok"`` or the error's text into ``results``."""
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401  # the import is not what is timed

    from unison.handlers.mlflow_store import make_client

    try:
        barrier.wait(timeout=120)
        client = make_client(uri)
        client.search_experiments()
        results.put("ok")
    except BaseException as err:  # reported to the test, which shows it
        results.put(f"{type(err).__name__}: {err}")
