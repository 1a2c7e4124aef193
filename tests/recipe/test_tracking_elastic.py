"""A run resumed at another world size: every tracker (MLflow, TensorBoard, W&B) holds each epoch
once, as metrics.json does, although the resume renumbers the trainer's iterations.

Real runs: `unison run` in a subprocess of its own session, 1 rank for 2 epochs (7 iterations an
epoch), then `--resume` at 2 ranks (4 iterations an epoch) for 2 more; MLflow in the run root's
SQLite store, TensorBoard read back with its EventAccumulator, W&B offline with its own reader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _procs import run_in_session

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "handlers"))
from _wandb_workers import history, offline_env, run_files  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240

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
  tensorboard: true
  mlflow: {{}}
  wandb: {{mode: offline}}
"""


def _run(path: Path, *args: str) -> None:
    done = run_in_session([sys.executable, "-m", "unison", "run", str(path), *args], RUN_TIMEOUT_S, ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_a_resume_at_another_world_size_leaves_every_epoch_once_in_every_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name, value in offline_env(tmp_path / "wandb-home").items():
        monkeypatch.setenv(name, value)
    (tmp_path / "tiny.py").write_text(MODULE)
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(root=tmp_path / "runs"))
    _run(path, "--nproc", "1")
    _run(path, "--nproc", "2", "--resume", "auto", "--set", "training.max_epochs=4")

    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    epochs = json.loads((run_dir / "metrics.json").read_text())["history"]
    assert [row["epoch"] for row in epochs] == [1, 2, 3, 4]
    expected = pytest.approx([row["train_loss"] for row in epochs])

    rows: dict[int, dict] = {}
    for file in run_files(run_dir):  # each start of the run is an offline file of the same W&B run
        for step, row in history(file).items():
            assert step not in rows or "train/loss" not in row, step  # no epoch twice
            rows.setdefault(step, {}).update(row)
    wandb_steps = sorted(step for step, row in rows.items() if "train/loss" in row)
    assert [rows[step]["train/loss"] for step in wandb_steps] == expected, rows

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    points = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.value for m in points] == expected, [(m.step, m.value) for m in points]

    (folder,) = {f.parent for f in run_dir.rglob("*tfevents*")}
    scalars = EventAccumulator(str(folder)).Reload().Scalars("train/loss")
    assert [e.value for e in scalars] == expected, [(e.step, e.value) for e in scalars]

    # one x axis: the steps go on after the resume (1 rank: 7 and 14; 2 ranks: 4 more an epoch)
    assert wandb_steps == [m.step for m in points] == [e.step for e in scalars] == [7, 14, 18, 22]
