"""unison/recipe/sweep/study.py: `unison tune`, a sweep whose trials are whole runs, pruned in agreement.

The config checks run in this process (fast). The sweeps are real: `unison tune` in a
subprocess of its own session (a timeout ends every process it started), 2 spawned gloo
ranks per trial, a SQLite study read back here with Optuna.
"""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procs import kill_tree, run_in_session

from unison.config import ConfigError, load_config

optuna = pytest.importorskip("optuna")

ROOT = Path(__file__).resolve().parents[3]
SWEEP_TIMEOUT_S = 150
LR = "training.optimizer_kwargs.lr"
EPOCHS, ITERS_PER_EPOCH = 3, 4  # 64 samples, 8 per rank per step, 2 ranks

MODULE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


def build(seed, n=80):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


class ZeroLinear(nn.Linear):
    """Starts at zero: with lr 0 the validation loss stays ln 2 = 0.693, above the pruner's bound."""

    def __init__(self):
        super().__init__(4, 2)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
'''

CONFIG = """\
name: tiny
model: {{type: !pyobject tiny.ZeroLinear}}
data: {{build: !pyobject tiny.build}}
training:
  max_epochs: {epochs}
  batch_size: 8
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.5}}
validation:
  metrics: {{loss: !pyobject unison.metrics.Loss}}
logging: {{root: {root}, progress: false}}
tuning:
  search_space:
    {lr}: {{type: categorical, choices: [0.0, 0.5]}}
{space}  sampler: RandomSampler
  sampler_kwargs: {{seed: {seed}}}
  pruner: ThresholdPruner
  pruner_kwargs: {{upper: 0.69}}
"""


def _draws(seed: int, n: int) -> list[float]:
    """What RandomSampler(seed) draws for the first n trials (it ignores the study's history)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    return [study.ask().suggest_categorical(LR, [0.0, 0.5]) for _ in range(n)]


def _seed_pruned_first() -> int:
    """A seed whose first trial draws lr 0 (pruned) and whose second draws 0.5 (completes)."""
    return next(s for s in range(100) if _draws(s, 2) == [0.0, 0.5])


def write_config(
    folder: Path, *, seed: int = 0, epochs: int = EPOCHS, extra: str = "", space: str = ""
) -> Path:
    (folder / "tiny.py").write_text(MODULE)
    path = folder / "config.yaml"
    path.write_text(CONFIG.format(epochs=epochs, root=folder / "runs", lr=LR, seed=seed, space=space) + extra)
    return path


def tune_command(config: Path, trials: int, *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "unison",
        "tune",
        str(config),
        "--trials",
        str(trials),
        "--nproc",
        "2",
        *more,
    ]


def study_trials(folder: Path, name: str = "tiny") -> list:
    storage = f"sqlite:///{folder / 'runs' / name / f'tune-{name}' / 'study.db'}"
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def counts_of(trials: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trials:
        out[t.state.name] = out.get(t.state.name, 0) + 1
    return out


# -- the tuning: section, checked before anything is spawned ------------------------------


@pytest.mark.parametrize(
    ("extra", "key", "says"),
    [
        (
            "    training.lrr: {type: float, low: 0.1, high: 1}\n",
            "tuning.search_space.training.lrr",
            "Did you mean 'lr'",
        ),
        ("    training.batch_size: {type: float, low: 4, high: 8}\n", "training.batch_size", "use type: int"),
        ("    training.seed: {type: int, low: 0, high: 4, log: true}\n", "training.seed.low", "low > 0"),
        ("    training.amp: {type: categorical, choices: []}\n", "training.amp.choices", "non-empty list"),
        ("    training.loss: {type: categorical, choices: [a]}\n", "training.loss", "!pyobject"),
        ("    logging.root: {type: categorical, choices: [a, b]}\n", "logging.root", "sweep folder"),
        ("    training: {type: categorical, choices: [a]}\n", "search_space.training", "is a section"),
        ("    training.lr: {type: float, low: 0.1, hgih: 1}\n", "training.lr.hgih", "Did you mean 'high'"),
    ],
)
def test_a_bad_search_space_entry_names_its_key_line_and_fix(
    tmp_path: Path, extra: str, key: str, says: str
) -> None:
    path = write_config(tmp_path, space=extra)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{path}:" in message and key in message and says in message, message
    assert info.value.line == path.read_text().splitlines().index(extra.splitlines()[0]) + 1


@pytest.mark.parametrize(
    ("setting", "key", "says"),
    [
        ("tuning.direction=maximize", "tuning.direction", "direction: minimize"),
        ("tuning.metric=accuracy", "tuning.metric", "no validation metric named 'accuracy'"),
        ("tuning.storage=study.db", "tuning.storage", "sqlite:///"),
        ("tuning.storage=sqlite://", "tuning.storage", "in-memory"),
        ("tuning.sampler=optuna.samplers.TPESampler", "tuning.sampler", "never a dotted path"),
        ("tuning.study_name=../up", "tuning.study_name", "not a folder name"),
    ],
)
def test_bad_tuning_keys_are_refused_with_the_fix(tmp_path: Path, setting: str, key: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        load_config(write_config(tmp_path), [setting])
    assert info.value.key_path == key


def test_direction_and_metric_default_to_the_watched_metric(tmp_path: Path) -> None:
    tuning = load_config(write_config(tmp_path)).tuning
    assert (tuning.metric, tuning.direction) == ("loss", "minimize")


def test_a_config_without_a_tuning_section_is_untouched(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    path.write_text(path.read_text().split("tuning:")[0])
    assert load_config(path).tuning.metric is None


@pytest.mark.parametrize(
    ("setting", "key", "says"),
    [
        ("tuning.sampler=TPESamplr", "tuning.sampler", "Did you mean 'TPESampler'"),
        ("tuning.sampler=BaseSampler", "tuning.sampler", "is not one of optuna.samplers"),
        ("tuning.pruner_kwargs={uper: 0.5}", "tuning.pruner_kwargs.uper", "Did you mean 'upper'"),
        ("tuning.pruner_kwargs={}", "tuning.pruner_kwargs", "ThresholdPruner"),
        (
            "tuning.search_space={model.kwargs.width: {type: int, low: 1, high: 2}}",
            "search_space.model.kwargs.width",
            "takes no argument 'width'",
        ),
        (f"tuning.search_space={{{LR}: {{type: float, low: -1, high: 1}}}}", LR, "Invalid learning rate"),
    ],
)
def test_optuna_classes_and_drawn_values_are_checked_before_spawning(
    tmp_path: Path, setting: str, key: str, says: str
) -> None:
    from unison.recipe.sweep.space import plan_sweep

    with pytest.raises(ConfigError, match=says) as info:
        plan_sweep(write_config(tmp_path), [setting])
    assert key in info.value.key_path or key in str(info.value), str(info.value)
    assert not (tmp_path / "runs").exists()  # nothing written, nothing spawned


def test_tune_help_lists_its_options(capsys) -> None:
    from unison.cli import main

    with pytest.raises(SystemExit) as info:
        main(["tune", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(option in out for option in ("--trials", "--nproc", "--set", "KEY=VALUE")), out


def test_tune_without_optuna_fails_naming_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    from unison.cli import main

    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    assert main(["tune", str(write_config(tmp_path)), "--trials", "1"]) == 2
    assert "pip install 'unison[tune]'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_optuna_is_imported_inside_functions_of_the_cli_only() -> None:
    """Importing unison (any module of it) never needs Optuna: it is an optional extra."""
    found = []
    for path in sorted((ROOT / "unison").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n == "optuna" or n.startswith("optuna.") for n in names):
                found.append((path.relative_to(ROOT).as_posix(), node.col_offset))
    inside = ("unison/cli/", "unison/recipe/")  # the sweep's command and the recipe's sweep plan
    assert found and all(p.startswith(inside) and indent > 0 for p, indent in found), found


# -- sweeps: pruning agreed by all ranks, resume, best.yaml, signals --------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * SWEEP_TIMEOUT_S + 120)
def test_a_pruned_trial_stops_every_rank_at_once_and_the_sweep_goes_on_and_resumes(tmp_path: Path) -> None:
    config = write_config(tmp_path, seed=_seed_pruned_first())
    first = run_in_session(tune_command(config, 2), SWEEP_TIMEOUT_S, ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]

    pruned, complete = study_trials(tmp_path)
    assert (pruned.params[LR], pruned.state.name) == (0.0, "PRUNED")
    assert (complete.params[LR], complete.state.name) == (
        0.5,
        "COMPLETE",
    )  # the sweep went on after the prune
    assert pruned.intermediate_values == {1: pytest.approx(math.log(2))}
    assert complete.value == pytest.approx(min(complete.intermediate_values.values()))
    assert sorted(complete.intermediate_values) == [1, 2, 3]

    records = {
        t.number: json.loads((Path(t.user_attrs["run_dir"]) / "trial.json").read_text())
        for t in (pruned, complete)
    }
    ranks_pruned = [(r["epochs"], r["iterations"]) for r in records[0]["ranks"]]
    assert ranks_pruned == [(1, ITERS_PER_EPOCH)] * 2  # both ranks stopped after the same iteration
    assert [(r["epochs"], r["iterations"]) for r in records[1]["ranks"]] == [
        (EPOCHS, EPOCHS * ITERS_PER_EPOCH)
    ] * 2
    for trial in (pruned, complete):
        run_dir = Path(trial.user_attrs["run_dir"])
        assert run_dir.parent.name == f"trial-{trial.number:04d}"
        assert (run_dir / "metrics.json").is_file() and (run_dir / "checkpoints" / "manifest.json").is_file()
        assert any((run_dir / "tb").iterdir())
    assert (
        "ThresholdPruner pruned trial 0"
        in (Path(pruned.user_attrs["run_dir"]) / "logs" / "rank0.log").read_text()
    )
    assert "best trial: 1" in first.stdout and f"{LR}: 0.5" in first.stdout

    again = run_in_session(tune_command(config, 3), SWEEP_TIMEOUT_S, ROOT)
    assert again.returncode == 0, again.stderr[-5000:]
    trials = study_trials(tmp_path)
    assert [t.number for t in trials] == [0, 1, 2] and trials[2].state.name in ("PRUNED", "COMPLETE")
    assert "2 finished trials" in again.stderr and "running 1 more" in again.stderr

    import unison.recipe.phases
    from unison.recipe.sweep.study import tune

    done = tune(config, trials=3, nproc=2)  # nothing left to run: nothing is spawned
    assert (done["trials"], done["counts"]) == ([], counts_of(study_trials(tmp_path)))
    assert done["best"]["number"] == 1 and done["best"]["params"] == {LR: 0.5}

    best = tmp_path / "runs" / "tiny" / "tune-tiny" / "best.yaml"
    saved_path = list(sys.path)
    try:
        results = unison.recipe.run(str(best), overrides=["training.max_epochs=1"])
    finally:
        sys.path[:] = saved_path
    assert results["world_size"] == 1 and results["iterations"] == 2 * ITERS_PER_EPOCH
    assert load_config(best).training.optimizer_kwargs["lr"] == 0.5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(SWEEP_TIMEOUT_S + 60)
def test_sigterm_marks_the_running_trial_fail(tmp_path: Path) -> None:
    config = write_config(tmp_path, epochs=10_000, extra="checkpoint: {every_epochs: 1000}\n")
    proc = subprocess.Popen(
        tune_command(config, 2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        logs = tmp_path / "runs" / "tiny" / "tune-tiny" / "trial-0000"
        while not any("epoch 2/" in p.read_text() for p in logs.glob("*/logs/rank0.log")):
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the first trial did not start training"
            )
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)  # the sweep process only: it relays to its ranks
        out, _ = proc.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        kill_tree(proc)
    assert proc.returncode in (75, 128 + signal.SIGTERM), out[-4000:]
    (trial,) = study_trials(tmp_path)
    assert trial.state.name == "FAIL" and "fail_reason" in trial.user_attrs, out[-4000:]
    assert "trial 0 marked FAIL" in out
