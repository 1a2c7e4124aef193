"""unison/recipe/build/tracking_wandb.py: `logging.wandb` in `unison run`, read back with W&B's own reader.

The checks and the pieces (the run's config, a sweep's trial keys) run in this process. The
runs are real: `unison run` in a subprocess of its own session, W&B offline into tmp_path (no
network, no login).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _procs import run_in_session

from unison.cli import main
from unison.config import ConfigError, load_config
from unison.config.wandb_config import WandbConfig
from unison.recipe.build.tracking_wandb import RUN_FILE, check_wandb, wandb_trial_overrides
from unison.recipe.planning.wandb_plan import flat_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "handlers"))
from _wandb_workers import history, offline_env, records, run_files  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240

MODULE = """
import torch
from torch.utils.data import TensorDataset


def build(seed, n=80, source=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:56], y[:56]), TensorDataset(x[56:68], y[56:68]), TensorDataset(x[68:], y[68:])
"""

CONFIG = """\
name: tiny
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 4, out_features: 2}}}}
data: {{build: !pyobject tiny.build}}
training:
  max_epochs: 2
  batch_size: 8
  optimizer_type: !pyobject torch.optim.SGD
  lr: 0.1
validation:
  metrics: {{accuracy: !pyobject unison.metrics.Accuracy, loss: !pyobject unison.metrics.Loss}}
checkpoint: {{metric: accuracy, mode: max, keep_last: 1}}
testing: {{enabled: false}}
logging:
  root: {root}
  progress: false
  tensorboard: false
  wandb:
    mode: offline
    tags: [tiny]
    log_checkpoints: true
"""


def write_config(folder: Path) -> Path:
    (folder / "tiny.py").write_text(MODULE)
    path = folder / "config.yaml"
    path.write_text(CONFIG.format(root=folder / "runs"))
    return path


# -- before spawning: the extra, `every` ---------------------------------------------------------


def test_without_wandb_the_run_fails_before_spawning_naming_the_key_and_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing wandb now fails
    with pytest.raises(ConfigError) as info:
        check_wandb(load_config(path))
    line = path.read_text().splitlines().index("  wandb:") + 1
    assert (info.value.key_path, info.value.line) == ("logging.wandb", line)
    assert main(["run", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}" in err and "pip install 'unison[wandb]'" in err, err
    assert not (tmp_path / "runs").exists()  # nothing written, nothing spawned


def test_every_needs_sync_points_and_names_must_not_be_empty(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    check_wandb(load_config(path, ["logging.wandb.every=10"]))
    with pytest.raises(ConfigError, match="training.sync_every") as info:
        check_wandb(load_config(path, ["logging.wandb.every=10", "training.sync_every=null"]))
    assert info.value.key_path == "logging.wandb.every"
    with pytest.raises(ConfigError, match="project is empty") as info:
        check_wandb(load_config(path, ["logging.wandb.project=' '"]))
    assert info.value.key_path == "logging.wandb.project"


# -- the run's config, a sweep's trials -------------------------------------------------------------


def test_the_run_config_is_the_resolved_config_flat_typed_and_with_credentials_masked(tmp_path: Path) -> None:
    config = load_config(
        write_config(tmp_path),
        [
            "training.optimizer_args=[1, 2]",
            'logging.mlflow={tracking_uri: "https://me:s3cret@mlflow.example.org"}',
        ],
    )
    flat = flat_config(config)
    assert flat["training.lr"] == 0.1 and flat["training.max_epochs"] == 2  # numbers stay numbers
    assert flat["training.optimizer_type"] == "torch.optim.SGD"  # a !pyobject as its dotted path
    assert flat["training.optimizer_args"] == [1, 2] and flat["logging.wandb.tags"] == ["tiny"]
    assert flat["model.kwargs.in_features"] == 4 and flat["training.scheduler_kwargs"] == {}
    assert "s3cret" not in json.dumps(flat) and "mlflow.example.org" in flat["logging.mlflow.tracking_uri"]


def test_a_sweeps_trials_share_its_project_and_are_grouped_under_it(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    config = load_config(path)
    sets = wandb_trial_overrides(config, "lr-search", 3)
    trial = load_config(path, ["name=trial-0003", *sets])
    assert trial.logging.wandb == WandbConfig(
        project="tiny",
        name="trial-0003",
        group="tune-lr-search",
        mode="offline",
        tags=["tiny"],
        log_checkpoints=True,
    )
    assert wandb_trial_overrides(load_config(path, ["logging.wandb=null"]), "lr-search", 3) == []


# -- runs ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_a_run_at_two_ranks_resumed_at_one_is_one_wandb_run_holding_what_metrics_json_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in offline_env(tmp_path / "wandb-home").items():
        monkeypatch.setenv(name, value)
    path = write_config(tmp_path)
    first = run_in_session(
        [sys.executable, "-m", "unison", "run", str(path), "--nproc", "2"], RUN_TIMEOUT_S, ROOT
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    (file,) = run_files(run_dir)  # one W&B run, from rank 0, inside the run folder
    newest = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())["checkpoints"][-1]
    resumed = run_in_session(
        [sys.executable, "-m", "unison", "run", str(path), "--nproc", "1", "--resume", "auto",
         "--set", "training.max_epochs=3"],
        RUN_TIMEOUT_S, ROOT,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert [f.stem for f in run_files(run_dir)] == [file.stem, file.stem]  # the same W&B run, continued

    found = records(file)
    (run,) = [r["run"] for r in found if r["type"] == "run"]
    record = json.loads((run_dir / RUN_FILE).read_text())
    assert (run["run_id"], run["project"], run["display_name"]) == (record["id"], "tiny", run_dir.name)
    assert run["tags"] == ["tiny"]
    config = run["config"]["update"]
    assert (config["training.lr"], config["model.type"], config["logging.wandb.mode"]) == (
        0.1,
        "torch.nn.Linear",
        "offline",
    )
    (artifact,) = [r for r in found if r["type"] == "artifact"]  # log_checkpoints: the newest, by reference
    assert newest["file"] in json.dumps(artifact)
    rows = {**history(found), **history(run_files(run_dir)[1])}
    epochs = json.loads((run_dir / "metrics.json").read_text())["history"]
    assert [row["epoch"] for row in epochs] == [1, 2, 3]
    steps = sorted(rows)
    assert (
        steps[:2] == [4, 8] and len(steps) == 3
    )  # each epoch's end once; 4 iterations an epoch at two ranks
    for name, column in (
        ("train/loss", "train_loss"),
        ("val/loss", "val_loss"),
        ("val/accuracy", "val_accuracy"),
    ):
        assert [rows[step][name] for step in steps] == pytest.approx([row[column] for row in epochs]), name


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_password_given_with_set_reaches_no_tracker_and_no_file_of_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B records the command line in its run's metadata; MLflow and TensorBoard get the config:
    the password is in none of their files, nor anywhere else under the run root."""
    for name, value in offline_env(tmp_path / "wandb-home").items():
        monkeypatch.setenv(name, value)
    path = write_config(tmp_path)
    secret = 'it\'s <a> "s3cret"'
    run = run_in_session(
        [sys.executable, "-m", "unison", "run", str(path), "--nproc", "1",
         "--set", f"data.kwargs.source=postgresql://me:{secret}@db.example.org/corpus",
         "--set", "logging.tensorboard=true", "--set", "logging.mlflow={}",
         "--set", "training.max_epochs=1"],
        RUN_TIMEOUT_S, ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    (file,) = run_files(run_dir)
    environments = [r["environment"] for r in records(file) if "args" in r.get("environment", {})]
    assert environments and all(  # W&B's metadata holds the command line, masked
        "data.kwargs.source=postgresql://me:***@db.example.org/corpus" in e["args"] for e in environments
    ), environments
    files = [f for f in (tmp_path / "runs").rglob("*") if f.is_file()]
    assert any(f.suffix == ".db" for f in files) and any("tfevents" in f.name for f in files)
    for found in files:
        data = found.read_bytes()
        assert b"s3cret" not in data and b"it's <a>" not in data, found
