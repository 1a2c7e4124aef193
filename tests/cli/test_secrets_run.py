"""A password in a store's URL is used to open the store, and appears in nothing a run writes
or prints: its files, its MLflow parameters and tags, its log lines, its errors."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest
from ignite.engine import Engine

import unison.handlers.mlflow as mlflow_handler
import unison.recipe.build.tracking as tracking
import unison.recipe.planning.tracking_store as tracking_store
from unison.config import ConfigError, load_config
from unison.handlers.mlflow import MLflowLogger
from unison.handlers.mlflow_store import artifacts_beside, make_client
from unison.recipe.phases import train_from_config
from unison.utils import setup_logging

PASSWORD = "Tr0ub4dor-s3cret"
STORE_PASSWORD = "c0rrect-h0rse"
TRACKING_URI = f"postgresql://mlflow:{PASSWORD}@db.example.org:5432/runs"
STORAGE = f"postgresql://optuna:{STORE_PASSWORD}@db.example.org/sweeps"

DATA = """\
import torch
from torch.utils.data import TensorDataset


def build(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    return ds, ds, ds
"""

CONFIG = """\
name: secret
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 4, out_features: 2}}}}
data: {{build: !pyobject {module}.build}}
training: {{max_epochs: {epochs}, batch_size: 4, path: {root}}}
validation: {{metrics: {{accuracy: !pyobject unison.metrics.Accuracy}}}}
checkpoint: {{preemption: false}}
logging:
  progress: false
  tensorboard: true
  mlflow: {{tracking_uri: "{uri}", log_checkpoints: true}}
tuning:
  storage: "{storage}"
  search_space: {{training.lr: {{type: float, low: 0.01, high: 0.1}}}}
"""


class _Proxy:
    """An MLflow client of a local SQLite store that says it is the database's.

    unison leaves a database store's artefacts to the store (a server's artefact root); the
    SQLite file standing in for it keeps them beside itself, as for a SQLite store, and never
    in MLflow's default, ``./mlruns`` under the working directory.
    """

    def __init__(self, client: Any, uri: str, local: str) -> None:
        self._client, self.tracking_uri, self._local = client, uri, local

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def create_experiment(self, name: str, artifact_location: str | None = None, **kwargs: Any) -> str:
        return self._client.create_experiment(
            name, artifact_location or artifacts_beside(self._local), **kwargs
        )


@pytest.fixture
def store(tmp_path: Path, monkeypatch):
    """Every client made is recorded with the URI it was given, and writes to a SQLite file.
    Nothing is written in the working directory."""
    pytest.importorskip("mlflow")
    local = f"sqlite:///{tmp_path.resolve() / 'store' / 'mlflow.db'}"
    opened: list[str] = []
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def client(uri: str) -> _Proxy:
        opened.append(uri)
        return _Proxy(make_client(local), uri, local)

    monkeypatch.setattr(mlflow_handler, "make_client", client)
    monkeypatch.setattr(tracking, "make_client", client)
    yield opened, local
    assert list(cwd.iterdir()) == []  # no mlruns/ where the tests run


@pytest.fixture
def console() -> io.StringIO:
    """What unison's own console handler (as ``unison run`` sets it up) prints, at DEBUG, where the
    test redirects stderr to it (the handler writes to the stderr of the moment)."""
    logger = logging.getLogger("unison")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    setup_logging(level=logging.DEBUG)
    yield io.StringIO()
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def _config(tmp_path: Path, epochs: int) -> Path:
    module = f"secret_data_{tmp_path.name[-12:].replace('-', '_')}_{uuid.uuid5(uuid.NAMESPACE_URL, str(tmp_path)).hex[:8]}"
    (tmp_path / f"{module}.py").write_text(DATA)
    path = tmp_path / f"config-{epochs}.yaml"
    text = CONFIG.format(
        module=module, epochs=epochs, root=tmp_path / "runs", uri=TRACKING_URI, storage=STORAGE
    )
    path.write_text(text)
    return path


def _holding(folder: Path, secrets: tuple[str, ...]) -> list[str]:
    return [
        str(p)
        for p in folder.rglob("*")
        if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets)
    ]


@pytest.mark.slow  # two short runs into a new MLflow store: seconds
def test_a_run_and_its_resume_open_the_real_url_and_write_no_password(
    tmp_path: Path, store, console, monkeypatch
) -> None:
    opened, local = store
    monkeypatch.setattr(sys, "path", list(sys.path))
    with contextlib.redirect_stderr(console):
        first = train_from_config(load_config(_config(tmp_path, epochs=1)))
        again = train_from_config(load_config(_config(tmp_path, epochs=2)), resume="auto")
    assert again["run_dir"] == first["run_dir"] and again["epochs"] == 2
    assert opened and set(opened) == {TRACKING_URI}  # the store is opened with the password

    secrets = (PASSWORD, STORE_PASSWORD)
    run_dir = Path(first["run_dir"])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "mlflow-run.json").is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*")) and list((run_dir / "logs").glob("rank0.log"))
    assert _holding(tmp_path / "runs", secrets) == []  # config.yaml, metrics.json, logs, TensorBoard...
    assert _holding(tmp_path / "store", secrets) == []  # the MLflow store: parameters, tags, artefacts
    printed = console.getvalue()
    assert "MLflow: run" in printed and "mlflow:***@db.example.org" in printed
    assert not any(s in printed for s in secrets)

    client = make_client(local)
    (run,) = client.search_runs([client.get_experiment_by_name("secret").experiment_id])  # resumed: one run
    assert (
        run.data.params["logging.mlflow.tracking_uri"] == "postgresql://mlflow:***@db.example.org:5432/runs"
    )
    assert run.data.params["tuning.storage"] == "postgresql://optuna:***@db.example.org/sweeps"
    changed = {k for k in run.data.tags if k.startswith("changed_on_resume.")}
    assert changed == {"changed_on_resume.training.max_epochs"}  # the masked URL is no change
    assert "tracking_uri" not in (run_dir / "changes-on-resume.jsonl").read_text()


def test_config_errors_that_quote_a_url_mask_its_password(tmp_path: Path) -> None:
    path = _config(tmp_path, epochs=1)
    bad = f"ftp://mlflow:{PASSWORD}@db.example.org/runs"
    with pytest.raises(ConfigError) as info:
        tracking_store.check_tracking(load_config(path, [f'logging.mlflow.tracking_uri="{bad}"']))
    assert "ftp://mlflow:***@db.example.org/runs" in str(info.value) and PASSWORD not in str(info.value)
    assert PASSWORD not in info.value.problem


def test_a_saved_config_with_its_password_masked_says_where_the_password_goes(tmp_path: Path) -> None:
    path = _config(tmp_path, epochs=1)
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_PASSWORD") as info:
        tracking_store.check_tracking(
            load_config(path, ['logging.mlflow.tracking_uri="postgresql://mlflow:***@db/runs"'])
        )
    assert info.value.key_path == "logging.mlflow.tracking_uri" and "PGPASSWORD" in str(info.value)


def test_a_store_that_fails_to_open_is_reported_with_the_password_masked(tmp_path: Path, monkeypatch) -> None:
    def refuse(uri: str) -> Any:
        raise RuntimeError(f"could not connect to {uri}")

    monkeypatch.setattr(mlflow_handler, "make_client", refuse)
    trainer = Engine(lambda e, b: None)
    MLflowLogger(TRACKING_URI, trainer=trainer, experiment="x").attach()
    with pytest.raises(RuntimeError) as info:
        trainer.run([0], max_epochs=1)
    text = "".join(traceback.format_exception(info.value))
    assert "could not connect to postgresql://mlflow:***@db.example.org" in text and PASSWORD not in text
