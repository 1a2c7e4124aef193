"""``logging.mlflow`` in a run and a sweep: the store, the parameters, the tags, the parent run.

- :func:`check_tracking`, in the launching process before any rank starts: MLflow is
  installed, the tracking URI is one a config may name, ``every`` has sync points to use.
- :func:`store`: where the run goes. Left out, a SQLite file in the output root,
  ``<logging.root>/mlflow.db``, with artefacts beside it in ``<logging.root>/mlartifacts``:
  nothing to start, and one store (one ``mlflow ui``) for every run under that root. MLflow 3
  keeps its plain-folder store (``file:``) in maintenance mode and refuses it by default, so
  the local store is SQLite. A path given there stays inside the root (a config never reaches
  outside its folder; :func:`~unison.utils.confine.confined_path` checks it as SQLite will read
  it, percent-decoded); a URL (``https://``, ``databricks``, ``sqlite:////absolute/path``, a
  database) is the user's own choice and is taken as it is.
- :func:`attach_tracking`, on every rank: an :class:`~unison.handlers.mlflow.MLflowLogger`
  with the resolved config as parameters (:func:`params_of`) and the run's tags
  (:func:`run_tags`); only rank 0 opens the store.
- :func:`sweep_tracking`: ``unison tune``'s parent run, and the ``--set`` keys that nest each
  trial's run under it, in the same experiment (:func:`trial_overrides`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch

from unison.config import Config, ConfigError, PyObjectRef
from unison.distributed import get_rank, get_world_size
from unison.handlers.mlflow import MLflowLogger
from unison.handlers.mlflow_store import (
    artifacts_beside,
    limited,
    make_client,
    open_experiment,
    record_run,
    recorded_run,
)
from unison.handlers.mlflow_store import key as metric_key
from unison.recipe.references import _References
from unison.utils import get_logger
from unison.utils.confine import ConfinementError, confined_path
from unison.utils.git import git_commit
from unison.utils.secrets import MASK, redact_url
from unison.utils.version import __version__

if TYPE_CHECKING:
    from unison.recipe.steps import RunParts
    from unison.recipe.tune_space import SweepPlan

_log = get_logger("unison.recipe.run")

EXTRA = "pip install 'unison[mlflow]'"
URL_SCHEMES = ("http", "https", "databricks", "databricks-uc", "postgresql", "mysql", "mssql")
"""Tracking URIs taken as they are (a server or a database the user names), besides ``sqlite:////abs``."""
RUN_FILE = "mlflow-run.json"
"""In a run folder (and a sweep folder): the MLflow run it writes to, continued on resume."""


def _error(config: Config, key: str, message: str) -> ConfigError:
    return _References.of(config).error(key, message)


def check_tracking(config: Config) -> None:
    """Before spawning: with ``logging.mlflow`` set, MLflow is installed, its URI is allowed, and
    ``every`` has sync points to read the loss at.

    Raises:
        ConfigError: naming the key (file and line), the value and the fix.
    """
    m = config.logging.mlflow
    if m is None:
        return
    try:
        found = importlib.util.find_spec("mlflow") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    if not found:
        raise _error(
            config,
            "logging.mlflow",
            f"logging.mlflow is set, but MLflow is not installed here: {EXTRA} (or pip install mlflow-skinny), "
            "or remove logging.mlflow",
        )
    store(config)
    for key in ("experiment", "run_name", "parent_run_id"):
        if getattr(m, key) is not None and not str(getattr(m, key)).strip():
            raise _error(
                config, f"logging.mlflow.{key}", f"{key} is empty; give a name or null for the default"
            )
    if m.every is not None and (m.every < 1 or config.training.sync_every is None):
        raise _error(
            config,
            "logging.mlflow.every",
            f"every: {m.every} must be a positive number of iterations, read at the trainer's sync points "
            f"(training.sync_every: {config.training.sync_every}); set training.sync_every, or every: null "
            "for epoch ends only",
        )


def output_root(config: Config) -> Path:
    """The folder runs go to: ``training.path`` or ``logging.root``, absolute."""
    return Path(config.training.path or config.logging.root).resolve()


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


def params_of(config: Config) -> dict[str, str]:
    """The resolved config as MLflow parameters: dotted keys (``training.lr``), text values;
    ``!pyobject`` references as their dotted path, null as ``null``, lists as JSON."""
    out: dict[str, str] = {}

    def text(value: Any) -> str:
        if value is None or isinstance(value, bool):
            return json.dumps(value)
        if isinstance(value, PyObjectRef):
            return value.path
        if isinstance(value, (list, tuple, dict)):
            return json.dumps(value, default=lambda v: v.path if isinstance(v, PyObjectRef) else str(v))
        return str(value)

    def walk(value: Any, key: str) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, (type, PyObjectRef)):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
        elif isinstance(value, dict) and value:
            for name, item in value.items():
                walk(item, f"{key}.{name}")
        else:
            out[key] = text(value)

    walk(config, "")
    return out


def run_tags(config: Config, run_dir: Path | None = None) -> dict[str, str]:
    """World size, backend, strategy, versions, the config's file and the git commit of the
    working folder (MLflow's ``mlflow.source.git.commit``), when :func:`~unison.utils.git.git_commit`
    can read one safely."""
    dist = torch.distributed
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
    tags = {
        "unison.world_size": str(get_world_size()),
        "unison.backend": backend,
        "unison.strategy": str(getattr(config.parallel, "strategy", "ddp")),
        "unison.version": __version__,
        "torch.version": torch.__version__,
    }
    source = config.origin.file
    if source:
        tags["unison.config"] = str(source)
    if run_dir is not None:
        tags["unison.run_dir"] = str(Path(run_dir).resolve())
    commit = git_commit(Path.cwd())
    if commit is not None:
        tags["mlflow.source.git.commit"] = commit
    return tags


def final_artifacts(parts: RunParts, run_dir: Path) -> list[tuple[Path, str | None]]:
    """What ``log_checkpoints`` logs at the end: the config as run, and the best checkpoint (the
    newest without a ranking metric), a file or a sharded checkpoint's folder."""
    out: list[tuple[Path, str | None]] = [(run_dir / "config.yaml", None)]
    checkpoint = parts.checkpoint
    if checkpoint is not None:
        entries = checkpoint.manifest.entries
        entry = checkpoint.best or (entries[-1] if entries else None)
        if entry is not None:
            path = checkpoint.folder / entry.file
            out.append((path, f"checkpoints/{path.name}" if path.is_dir() else "checkpoints"))
    return out


def attach_tracking(config: Config, parts: RunParts, run_dir: Path) -> MLflowLogger | None:
    """``logging.mlflow``: builds and attaches the MLflow logger; None when it is off.

    Distributed:
        Every rank builds and attaches it alike (it joins the trainer's sync point with
        ``every``); only rank 0 opens the store, at the trainer's ``STARTED``.
    """
    m = config.logging.mlflow
    if m is None:
        return None
    uri, artifact_location = store(config)
    logger = MLflowLogger(
        uri,
        trainer=parts.trainer,
        evaluators={"val": parts.evaluator},
        experiment=m.experiment or config.name,
        run_name=m.run_name or run_dir.name,
        params=params_of(config),
        tags=run_tags(config, run_dir),
        parent_run_id=m.parent_run_id,
        every=m.every,
        artifact_location=artifact_location,
        artifacts=(lambda: final_artifacts(parts, run_dir)) if m.log_checkpoints else None,
        run_file=run_dir / RUN_FILE,
    )
    logger.attach(parts.trainer)
    return logger


def log_test_metrics(config: Config, run_dir: Path, metrics: dict[str, float]) -> None:
    """``logging.mlflow``: the test phase's metrics, as ``test/<name>``, into the run training wrote
    (found through ``<run>/mlflow-run.json``; the run has ended, its status is kept).

    Distributed:
        Call it on every rank; rank 0 alone writes, and nothing is collective.
    """
    if config.logging.mlflow is None or not metrics or get_rank() != 0:
        return
    uri, _ = store(config)
    client = make_client(uri)
    run_id = recorded_run(client, run_dir / RUN_FILE)
    if run_id is None:
        _log.warning(
            "MLflow: no run recorded in %s; the test metrics are not logged there", run_dir / RUN_FILE
        )
        return
    for name, value in metrics.items():
        client.log_metric(run_id, metric_key(f"test/{name}"), float(value))


@dataclass(frozen=True)
class SweepRun:
    """A sweep's parent run: where it is, and its id."""

    tracking_uri: str
    experiment: str
    run_id: str


def trial_overrides(sweep: SweepRun | None, number: int) -> list[str]:
    """``--set`` keys for trial ``number``: the sweep's store and experiment, its own run name,
    nested under the sweep's run. Empty without a sweep run."""
    if sweep is None:
        return []
    values = {
        "tracking_uri": sweep.tracking_uri,
        "experiment": sweep.experiment,
        "run_name": f"trial-{number:04d}",
        "parent_run_id": sweep.run_id,
    }
    return [f"logging.mlflow.{key}={json.dumps(value)}" for key, value in values.items()]


@contextlib.contextmanager
def sweep_tracking(plan: SweepPlan) -> Iterator[SweepRun | None]:
    """``unison tune`` with ``logging.mlflow``: the sweep's parent run, opened by the sweep process
    (continued by a later ``unison tune`` of the same sweep folder) and ended FINISHED, or FAILED
    when the sweep ends with an error. Yields None when ``logging.mlflow`` is off."""
    config = plan.config
    m = config.logging.mlflow
    if m is None:
        yield None
        return
    check_tracking(config)
    uri, artifact_location = store(config)
    experiment = m.experiment or config.name
    client = make_client(uri)
    record = plan.folder / RUN_FILE
    run_id = recorded_run(client, record)
    if run_id is None:
        tags = {**run_tags(config), "unison.sweep": str(plan.folder), "unison.study": plan.study_name}
        run = client.create_run(
            open_experiment(client, experiment, artifact_location),
            run_name=f"tune-{plan.study_name}",
            tags=tags,
        )
        run_id = run.info.run_id
        from mlflow.entities import Param

        client.log_batch(run_id, params=[Param(k, v) for k, v in limited(params_of(config)).items()])
        record_run(record, run_id, uri)
    else:
        client.update_run(run_id, status="RUNNING")
    _log.info("MLflow: sweep run %s in experiment %r at %s", run_id, experiment, redact_url(uri))
    status = "FAILED"
    try:
        yield SweepRun(uri, experiment, run_id)
        status = "FINISHED"
    finally:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, status)
