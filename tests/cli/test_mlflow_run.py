"""unison/recipe/build/tracking.py: `logging.mlflow` in `unison run` and `unison tune`, read back with MLflow's client.

The checks and the pieces (store, parameters, git commit) run in this process. The runs
are real: `unison run` and `unison tune` in a subprocess of their own session, 2 spawned
gloo ranks, a SQLite store in tmp_path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli_parts import config as quiet_config
from _cli_parts import parts_of, resolved
from _procs import run_in_session

from unison.cli import main
from unison.config import ConfigError, load_config
from unison.config.mlflow_config import MLflowConfig
from unison.recipe.build.tracking import RUN_FILE, git_commit, params_of, run_tags
from unison.recipe.phases import collect_results
from unison.recipe.planning.tracking_store import check_tracking, store
from unison.recipe.sweep.tracking_sweep import SweepRun, trial_overrides

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240
SHA = "0123456789abcdef0123456789abcdef01234567"

MODULE = """
import torch
from torch.utils.data import TensorDataset


def build(seed, n=80):
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
  max_epochs: 3
  batch_size: 8
  optimizer_type: !pyobject torch.optim.SGD
  lr: 0.1
validation:
  metrics: {{accuracy: !pyobject unison.metrics.Accuracy, loss: !pyobject unison.metrics.Loss}}
checkpoint: {{metric: accuracy, mode: max, keep_last: 1}}
logging:
  root: {root}
  progress: false
  tensorboard: false
  mlflow:
    log_checkpoints: true
tuning:
  search_space:
    training.lr: {{type: categorical, choices: [0.05, 0.5]}}
  sampler: RandomSampler
  sampler_kwargs: {{seed: 0}}
  pruner: null
"""


def write_config(folder: Path) -> Path:
    (folder / "tiny.py").write_text(MODULE)
    path = folder / "config.yaml"
    path.write_text(CONFIG.format(root=folder / "runs"))
    return path


def client_of(uri: str) -> Any:
    mlflow = pytest.importorskip("mlflow")
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


# -- before spawning: the extra, the store, `every` --------------------------------------------


def test_without_mlflow_the_run_fails_before_spawning_naming_the_key_and_the_extra(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    path = write_config(tmp_path)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importing mlflow now fails
    with pytest.raises(ConfigError) as info:
        check_tracking(load_config(path))
    line = path.read_text().splitlines().index("  mlflow:") + 1
    assert (info.value.key_path, info.value.line) == ("logging.mlflow", line)
    assert main(["run", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}" in err and "pip install 'unison[mlflow]'" in err, err
    assert not (tmp_path / "runs").exists()  # nothing written, nothing spawned


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (None, "sqlite:///{root}/mlflow.db"),
        ("tracking/team.db", "sqlite:///{root}/tracking/team.db"),
        ("sqlite:////srv/mlflow/mlflow.db", "sqlite:////srv/mlflow/mlflow.db"),
        ("https://mlflow.example.org", "https://mlflow.example.org"),
        ("databricks", "databricks"),
        ("postgresql://user@db/mlflow", "postgresql://user@db/mlflow"),
    ],
)
def test_the_store_is_the_root_sqlite_file_a_path_inside_it_or_a_url(
    tmp_path: Path, uri: str | None, expected: str
) -> None:
    config = load_config(write_config(tmp_path), [f"logging.mlflow.tracking_uri={json.dumps(uri)}"])
    found, artifacts = store(config)
    root = (tmp_path / "runs").resolve()
    assert found == expected.format(root=root)
    if found.startswith("sqlite:"):  # artefacts beside the file, never in the working folder
        assert artifacts == (Path(found.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    else:
        assert artifacts is None  # a server keeps them where it says


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("../elsewhere.db", "outside the output root"),
        ("%2F..%2F..%2Felsewhere.db", "percent-encoded"),  # SQLAlchemy decodes it: /../../elsewhere.db
        ("%252E%252E/elsewhere.db", "percent-encoded"),
        ("/tmp/elsewhere.db", "outside the output root"),
        ("sqlite:///relative.db", "absolute file"),
        ("sqlite://", "absolute file"),
        ("file:///tmp/mlruns", "refuses folder"),
        ("ftp://host/x", "not a store"),
    ],
)
def test_a_store_outside_the_root_or_of_no_known_kind_is_refused(tmp_path: Path, uri: str, says: str) -> None:
    path = write_config(tmp_path)
    with pytest.raises(ConfigError, match=says) as info:
        check_tracking(load_config(path, [f"logging.mlflow.tracking_uri={json.dumps(uri)}"]))
    assert info.value.key_path == "logging.mlflow.tracking_uri"


def test_every_needs_sync_points(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    check_tracking(load_config(path, ["logging.mlflow.every=10"]))
    with pytest.raises(ConfigError, match="training.sync_every") as info:
        check_tracking(load_config(path, ["logging.mlflow.every=10", "training.sync_every=null"]))
    assert info.value.key_path == "logging.mlflow.every"


# -- parameters, tags, the git commit -----------------------------------------------------------


def test_params_are_the_resolved_config_flattened_to_dotted_keys(tmp_path: Path) -> None:
    config = load_config(
        write_config(tmp_path), ["training.optimizer_args=[1, 2]", "data.kwargs={a: {b: null}}"]
    )
    params = params_of(config)
    assert params["training.lr"] == "0.1"
    assert params["training.optimizer_type"] == "torch.optim.SGD"  # a !pyobject as its dotted path
    assert params["model.kwargs.in_features"] == "4"
    assert params["training.optimizer_args"] == "[1, 2]"
    assert params["data.kwargs.a.b"] == "null"
    assert params["training.scheduler_kwargs"] == "{}"
    assert params["logging.mlflow.log_checkpoints"] == "true"
    assert params["validation.metrics.loss"] == "unison.metrics.Loss"
    assert all(isinstance(v, str) for v in params.values()) and "!pyobject" not in "".join(params.values())


def _repo(folder: Path, head: str, refs: dict[str, str] | None = None, packed: str | None = None) -> Path:
    git = folder / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text(head + "\n")
    for ref, sha in (refs or {}).items():
        (git / ref).parent.mkdir(parents=True, exist_ok=True)
        (git / ref).write_text(sha + "\n")
    if packed is not None:
        (git / "packed-refs").write_text(packed)
    return git


def test_the_git_commit_is_read_from_the_files_without_running_anything(tmp_path: Path, monkeypatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a command was run")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    _repo(tmp_path / "loose", "ref: refs/heads/main", {"refs/heads/main": SHA})
    _repo(
        tmp_path / "packed",
        "ref: refs/heads/main",
        packed=f"# pack-refs\n{SHA} refs/heads/main\n^{'f' * 40}\n",
    )
    _repo(tmp_path / "detached", SHA)
    _repo(tmp_path / "unborn", "ref: refs/heads/main")
    _repo(tmp_path / "escape", "ref: ../../outside", {"refs/heads/main": SHA})
    (tmp_path / "loose" / "src" / "deep").mkdir(parents=True)
    main_git = _repo(tmp_path / "main", "ref: refs/heads/main", {"refs/heads/other": SHA[::-1]})
    linked = main_git / "worktrees" / "wt"
    linked.mkdir(parents=True)
    (linked / "HEAD").write_text("ref: refs/heads/other\n")
    (linked / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {linked}\n")

    assert git_commit(tmp_path / "loose") == SHA
    assert git_commit(tmp_path / "loose" / "src" / "deep") == SHA  # the work tree above
    assert git_commit(tmp_path / "packed") == SHA
    assert git_commit(tmp_path / "detached") == SHA
    assert git_commit(tmp_path / "wt") == SHA[::-1]  # a linked work tree: its HEAD, the common refs
    assert git_commit(tmp_path / "unborn") is None
    assert git_commit(tmp_path / "escape") is None


def test_tags_name_the_world_backend_strategy_and_versions(tmp_path: Path) -> None:
    import torch

    import unison

    tags = run_tags(load_config(write_config(tmp_path)), tmp_path)
    assert tags["unison.world_size"] == "1" and tags["unison.backend"] == "none"
    assert tags["unison.strategy"] == "ddp"
    assert (tags["unison.version"], tags["torch.version"]) == (unison.__version__, torch.__version__)
    assert tags["unison.config"] == str(tmp_path / "config.yaml")
    assert tags.get("mlflow.source.git.commit") == git_commit(Path.cwd())


def test_trial_overrides_nest_the_trial_under_the_sweep_run(tmp_path: Path) -> None:
    sweep = SweepRun(
        "sqlite:////abs/mlflow.db", "tiny", "1234e5" + "0" * 26
    )  # would read as a number unquoted
    config = load_config(write_config(tmp_path), trial_overrides(sweep, 3))
    assert config.logging.mlflow == MLflowConfig(
        tracking_uri=sweep.tracking_uri,
        experiment="tiny",
        run_name="trial-0003",
        parent_run_id=sweep.run_id,
        log_checkpoints=True,
    )
    assert trial_overrides(None, 3) == []


# -- runs ---------------------------------------------------------------------------------------


@pytest.mark.slow  # a new store makes its tables: seconds
def test_a_run_built_in_one_process_is_one_mlflow_run(tmp_path: Path) -> None:
    c = quiet_config(tmp_path)
    c.training.max_epochs = 2
    c.logging.root = str(tmp_path)
    c.logging.mlflow = MLflowConfig(experiment="in-process")
    parts = parts_of(c, resolved(), tmp_path / "run")
    parts.trainer.run(parts.train_loader, max_epochs=2)
    history = collect_results(parts, tmp_path, 1)["history"]
    uri = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    client = client_of(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("in-process").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "val/accuracy")] == [
        row["val_accuracy"] for row in history
    ]
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["run_id"] == run.info.run_id


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_two_rank_run_is_one_mlflow_run_holding_what_metrics_json_holds(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    result = run_in_session(
        [sys.executable, "-m", "unison", "run", str(path), "--nproc", "2"], RUN_TIMEOUT_S, ROOT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    client = client_of(f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])  # one run, not two

    assert (run.info.run_name, run.info.status) == (run_dir.name, "FINISHED")
    assert run.data.params["training.lr"] == "0.1"
    assert run.data.params["model.type"] == "torch.nn.Linear"
    tags = run.data.tags
    assert (tags["unison.world_size"], tags["unison.backend"], tags["unison.strategy"]) == (
        "2",
        "gloo",
        "ddp",
    )
    if shutil.which("git") and (ROOT / ".git").exists():
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        assert tags["mlflow.source.git.commit"] == head
    for name, key in (
        ("train/loss", "train_loss"),
        ("val/loss", "val_loss"),
        ("val/accuracy", "val_accuracy"),
    ):
        values = [m.value for m in client.get_metric_history(run.info.run_id, name)]
        assert values == pytest.approx([row[key] for row in metrics["history"]]), name  # one per epoch
    assert set(metrics["test"]) == {"accuracy", "loss"}
    for name, value in metrics["test"].items():  # the test phase, after training closed the run
        assert [m.value for m in client.get_metric_history(run.info.run_id, f"test/{name}")] == [
            pytest.approx(value)
        ], name
    best = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
    names = {client_path.path for client_path in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert len(names) == 1 and Path(names.pop()).name in {e["file"] for e in best["checkpoints"]}
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to((tmp_path / "runs").resolve())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_a_sweep_is_a_parent_run_with_one_nested_run_per_trial(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    path = write_config(tmp_path)
    path.write_text(path.read_text().replace("max_epochs: 3", "max_epochs: 1"))
    cmd = [sys.executable, "-m", "unison", "tune", str(path), "--trials", "2", "--nproc", "2"]
    result = run_in_session(cmd, 2 * RUN_TIMEOUT_S, ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    client = client_of(f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted((r for r in runs if r is not parent), key=lambda r: r.info.run_name)
    assert (parent.info.run_name, parent.info.status) == ("tune-tiny", "FINISHED")
    assert [r.info.run_name for r in children] == ["trial-0000", "trial-0001"]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert {r.info.status for r in children} == {"FINISHED"}
    trials = sorted(json.loads(p.read_text())["params"]["training.lr"] for p in tmp_path.rglob("trial.json"))
    assert sorted(float(r.data.params["training.lr"]) for r in children) == trials


def test_mlflow_is_imported_inside_functions_only() -> None:
    """Importing unison (any module of it) never needs MLflow: it is an optional extra."""
    import ast

    found = []
    for path in sorted((ROOT / "unison").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n == "mlflow" or n.startswith("mlflow.") for n in names):
                found.append((path.relative_to(ROOT).as_posix(), node.col_offset))
    assert found and all(indent > 0 for _, indent in found), found
    assert {p for p, _ in found} <= {
        "unison/handlers/mlflow.py",
        "unison/handlers/mlflow_store.py",
        "unison/recipe/build/tracking.py",
        "unison/recipe/sweep/tracking_sweep.py",
    }
