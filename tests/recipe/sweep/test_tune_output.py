"""unison/recipe/sweep/study.py, tune_mlflow.py: what a sweep shows. One line per trial on the terminal (the
ranks' lines stay in the trials' log files), no test phase for a pruned trial, and each trial's
state on its MLflow run, the best trial on the sweep's.

One real sweep, 2 trials of 1 rank: the first pruned, the second complete (test_study's seed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _procs import run_in_session
from test_study import LR, SWEEP_TIMEOUT_S, _seed_pruned_first, tune_command, write_config

pytest.importorskip("optuna")
pytest.importorskip("mlflow")

WITH_TEST_SET = "    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:72], y[64:72]), TensorDataset(x[72:], y[72:])\n"


def _sweep_config(folder: Path) -> Path:
    path = write_config(folder, seed=_seed_pruned_first())
    module = folder / "tiny.py"
    lines = module.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("return TensorDataset"))
    module.write_text("".join([*lines[:at], WITH_TEST_SET, *lines[at + 1 :]]))  # train, val and test
    path.write_text(path.read_text().replace("progress: false}", "progress: false, mlflow: {}}"))
    return path


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(SWEEP_TIMEOUT_S + 60)
def test_a_sweep_prints_one_line_per_trial_and_marks_its_trials_in_mlflow(tmp_path: Path) -> None:
    config = _sweep_config(tmp_path)
    command = tune_command(config, 2)
    command[command.index("--nproc") + 1] = "1"
    done = run_in_session(command, SWEEP_TIMEOUT_S, tmp_path, merge_output=True)  # cwd: nothing lands here
    out = done.stdout
    assert done.returncode == 0, out[-5000:]

    # The terminal: exactly one line per trial, none of the ranks' per-epoch or per-save lines.
    for number, state in ((0, "PRUNED"), (1, "COMPLETE")):
        lines = [line for line in out.splitlines() if re.search(rf"\btrial {number}\b", line)]
        assert len(lines) == 1 and state in lines[0] and f"{LR}=" in lines[0], out
    for chatter in ("Saved checkpoint", "epoch 1/", "run directory", "test:", "MLflow: run"):
        assert chatter not in out, out
    sweep = tmp_path / "runs" / "tiny" / "tune-tiny"
    (pruned_dir,) = sweep.glob("trial-0000/*/")
    (complete_dir,) = sweep.glob("trial-0001/*/")
    log = (complete_dir / "logs" / "rank0.log").read_text()
    assert "Saved checkpoint" in log and "epoch 1/" in log  # still in the trial's own log file

    # The pruned trial takes no test phase; the complete one does.
    pruned, complete = (json.loads((d / "metrics.json").read_text()) for d in (pruned_dir, complete_dir))
    assert "test" not in pruned and "pruned" in pruned["no_test_phase"], pruned
    assert "test" in complete and "no_test_phase" not in complete, complete

    # MLflow: the trials' states and statuses, the sweep's best trial; every file under tmp_path.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    parent = client.get_run(json.loads((sweep / "mlflow-run.json").read_text())["run_id"])
    runs = {
        d: client.get_run(json.loads((d / "mlflow-run.json").read_text())["run_id"])
        for d in (pruned_dir, complete_dir)
    }
    assert [(r.data.tags["optuna.trial.state"], r.info.status) for r in runs.values()] == [
        ("PRUNED", "KILLED"),
        ("COMPLETE", "FINISHED"),
    ]
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in runs.values())
    assert not any(k.startswith("test/") for k in runs[pruned_dir].data.metrics)
    assert any(k.startswith("test/") for k in runs[complete_dir].data.metrics)
    value = float(runs[complete_dir].data.tags["optuna.trial.value"])
    assert parent.data.tags["optuna.best_trial.number"] == "1" and parent.info.status == "FINISHED"
    assert float(parent.data.tags["optuna.best_trial.value"]) == value == parent.data.metrics["best/val/loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "runs", "tiny.py"]  # no mlruns/ here
