"""Where a config's runs go: the output root, and the MLflow store of ``logging.mlflow`` in it.

- :func:`root_setting` and :func:`output_root`: ``training.path``, else ``logging.root``;
- :func:`check_tracking`, in the launching process before any rank starts: MLflow is
  installed, the tracking URI is one a config may name, ``every`` has sync points to use
  (:func:`check_mlflow` without the URI, which the run's plan checks as it computes the store);
  :func:`check_tracker`, the checks every tracker's section shares (W&B's too).
- :func:`store`: where the run goes. Left out, a SQLite file in the output root,
  ``<logging.root>/mlflow.db``, with artefacts beside it in ``<logging.root>/mlartifacts``:
  nothing to start, and one store (one ``mlflow ui``) for every run under that root. MLflow 3
  keeps its plain-folder store (``file:``) in maintenance mode and refuses it by default, so
  the local store is SQLite. A path given there stays inside the root (a config never reaches
  outside its folder; :func:`~unison.utils.confine.confined_path` checks it as SQLite will read
  it, percent-decoded); a URL (``https://``, ``databricks``, ``sqlite:////absolute/path``, a
  database) is the user's own choice and is taken as it is.

:func:`unison.recipe.plan` computes the store once; the run, the test phase and a sweep
read it from the plan.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from unison.config import Config, ConfigError
from unison.handlers.mlflow_store import artifacts_beside
from unison.utils.confine import ConfinementError, confined_path
from unison.utils.secrets import MASK, redact_url

EXTRA = "pip install 'unison[mlflow]'"
URL_SCHEMES = ("http", "https", "databricks", "databricks-uc", "postgresql", "mysql", "mssql")
"""Tracking URIs taken as they are (a server or a database the user names), besides ``sqlite:////abs``."""


def _error(config: Config, key: str, message: str) -> ConfigError:
    return config.origin.error(tuple(key.split(".")), message)


def check_tracking(config: Config) -> None:
    """Before spawning: with ``logging.mlflow`` set, :func:`check_mlflow`, and its URI is allowed
    (:func:`store`).

    Raises:
        ConfigError: naming the key (file and line), the value and the fix.
    """
    check_mlflow(config)
    if config.logging.mlflow is not None:
        store(config)


def check_tracker(config: Config, name: str, module: str, missing: str, names: tuple[str, ...]) -> Any:
    """The check of a tracker's section ``logging.<name>`` (``mlflow``, ``wandb``) before spawning:
    its ``module`` is installed (``missing``: the tracker not found, and how to install it), the
    ``names`` given are not empty, and ``every`` has sync points to read the loss at. Returns the
    section; None when it is not set.

    Raises:
        ConfigError: naming the key (file and line), the value and the fix.
    """
    section = getattr(config.logging, name)
    if section is None:
        return None
    key = f"logging.{name}"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    if not found:
        raise _error(config, key, f"{key} is set, but {missing}, or remove {key}")
    for field in names:
        if getattr(section, field) is not None and not str(getattr(section, field)).strip():
            raise _error(config, f"{key}.{field}", f"{field} is empty; give a name or null for the default")
    if section.every is not None and (section.every < 1 or config.training.sync_every is None):
        raise _error(
            config,
            f"{key}.every",
            f"every: {section.every} must be a positive number of iterations, read at the trainer's sync "
            f"points (training.sync_every: {config.training.sync_every}); set training.sync_every, or every: "
            "null for epoch ends only",
        )
    return section


def check_mlflow(config: Config) -> None:
    """With ``logging.mlflow`` set: :func:`check_tracker`. The store is the plan's (:func:`store`,
    computed once)."""
    missing = f"MLflow is not installed here: {EXTRA} (or pip install mlflow-skinny)"
    check_tracker(config, "mlflow", "mlflow", missing, ("experiment", "run_name", "parent_run_id"))


def root_setting(config: Config) -> tuple[str, Path]:
    """The key that names the folder runs go to, and that folder as written: ``training.path``
    when it is set, else ``logging.root``."""
    if config.training.path:
        return "training.path", Path(config.training.path)
    return "logging.root", Path(config.logging.root)


def output_root(config: Config) -> Path:
    """The folder runs go to (:func:`root_setting`), absolute."""
    return root_setting(config)[1].resolve()


def store(config: Config) -> tuple[str, str | None]:
    """``(tracking URI, artefact location of a new experiment or None)`` of ``logging.mlflow``.

    Raises:
        ConfigError: a path outside the output root, a relative ``sqlite:///`` URL, a
            ``file:`` store, or a scheme MLflow is not given here.
    """
    m = config.logging.mlflow
    uri = None if m is None else m.tracking_uri
    root, key = output_root(config), "logging.mlflow.tracking_uri"
    if uri is not None and f":{MASK}@" in uri:
        raise _error(
            config,
            key,
            f"{redact_url(uri)!r}: the password reads {MASK}, as unison writes it into every saved config.yaml "
            "and record; give the store's real URL in your own config, or keep the password out of the config "
            "(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for a server, the database driver's own "
            "variable such as PGPASSWORD for a database)",
        )
    if uri is None:
        db = root / "mlflow.db"
    elif uri == "databricks" or urlsplit(uri).scheme in URL_SCHEMES:
        return uri, None  # a server or a database: it keeps the artefacts where it says
    elif uri.startswith("sqlite:"):
        if not uri.startswith("sqlite:////"):
            raise _error(
                config,
                key,
                f"{uri!r}: a SQLite URL names an absolute file (sqlite:////abs/path/mlflow.db); for a file in "
                f"the output root write its path alone (tracking_uri: mlflow.db, inside {root})",
            )
        return uri, artifacts_beside(uri)
    elif (urlsplit(uri).scheme and "://" in uri) or uri.startswith("file:"):
        raise _error(
            config,
            key,
            f"{uri!r}: not a store unison opens; give a SQLite file path inside {root}, sqlite:////abs/path.db, "
            f"or a tracking server's URL ({', '.join(URL_SCHEMES)}). MLflow 3 refuses folder (file:) stores",
        )
    else:
        try:
            db = confined_path(uri, root)
        except ConfinementError as err:
            raise _error(
                config,
                key,
                f"{err}: refused as a path outside the output root would be. A path here stays inside "
                f"{root}, written plainly (e.g. mlflow.db); for a store elsewhere write a URL, "
                "sqlite:////abs/path/mlflow.db",
            ) from None
    return f"sqlite:///{db}", artifacts_beside(f"sqlite:///{db}")
