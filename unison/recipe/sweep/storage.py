"""Where a sweep's study lives, as Optuna users write it, and how a killed sweep's trials are recovered.

``tuning.storage`` is read the way Optuna's own CLI reads a storage: a ``redis://`` URL is
Optuna's journal in Redis (``JournalStorage(JournalRedisBackend(url))``), any other URL a
database (``RDBStorage``), and a plain path a journal file
(``JournalStorage(JournalFileBackend(path))``, relative to the output root, and confined to
it as a SQLite file is; see :mod:`unison.config.tuning`).

A database storage records a heartbeat of each running trial (Optuna's own mechanism,
``heartbeat_interval`` and ``grace_period``): a trial whose sweep process was killed outright
(SIGKILL, a lost node) stops beating, and the next ``unison tune`` of the study marks it FAIL
and asks its values again (``RetryFailedTrialCallback``). Optuna's journal storages have no
heartbeat: such a trial stays RUNNING there, and does not count toward ``--trials``.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from unison.config.tuning import storage_file, storage_kind
from unison.recipe.sweep.space import import_optuna

HEARTBEAT_S = 30
"""How often the sweep process records that its running trial is alive (database storages)."""
GRACE_S = 120
"""How long a trial may go without a heartbeat before the next sweep marks it FAIL."""
RETRIES = 2
"""How many times the values of a trial lost with its sweep process are asked again."""


def make_storage(storage: str, root: Path) -> Any:
    """The Optuna storage ``storage`` names (see the module's docstring); ``root`` is the output
    root a relative journal path is in.

    Raises:
        ImportError: Redis is named and its client is not installed (``pip install redis``).
        Exception: what Optuna raises for a storage it cannot open.
    """
    optuna = import_optuna()
    kind = storage_kind(storage)
    journal = optuna.storages.journal
    path = storage_file(storage, root)  # checked with the config; a relative path is in the root
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "journal":
        assert path is not None  # a journal is a file
        return optuna.storages.JournalStorage(journal.JournalFileBackend(str(path)))
    if kind == "redis":
        try:
            backend = journal.JournalRedisBackend(storage)
        except ImportError as err:
            raise ImportError(
                f"a redis:// storage needs the Redis client: pip install redis ({err})"
            ) from None
        return optuna.storages.JournalStorage(backend)
    retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    retry_cls = retry_cls or optuna.storages.RetryFailedTrialCallback
    accepted = inspect.signature(optuna.storages.RDBStorage).parameters
    callback = next(
        (n for n in ("heartbeat_stale_trial_callback", "failed_trial_callback") if n in accepted),
        None,
    )
    kwargs: dict[str, Any] = {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S}
    url = storage if path is None else f"sqlite:///{path}"
    with warnings.catch_warnings():  # the heartbeat is experimental in Optuna, and long-standing
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if callback is not None:
            kwargs[callback] = retry_cls(max_retry=RETRIES)
        return optuna.storages.RDBStorage(url, **kwargs)


def fail_stale_trials(study: Any) -> None:
    """Marks FAIL the trials of ``study`` whose heartbeat stopped (their sweep process was killed);
    their values are asked again. Nothing for a storage without heartbeats."""
    optuna = import_optuna()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def optuna_quiet() -> Iterator[None]:
    """Optuna's own per-trial log lines (and tracebacks of failed trials) are left out: the sweep
    prints one line per trial of its own."""
    optuna = import_optuna()
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)
