"""unison/recipe/sweep/study.py: what a sweep counts, when it stops, and how it recovers, in one process.

The ranks are replaced by a stand-in for ``launch_config`` that returns a run's results at
once (the value of each trial given by the test); Optuna, the storage, the loop, the
counting and best.yaml are real. The sweeps with real ranks are in test_study.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_study import LR, counts_of, study_trials, write_config

from unison.config import ConfigError, load_config

optuna = pytest.importorskip("optuna")

import unison.recipe.sweep.study as tune_module  # noqa: E402
from unison.cli import main  # noqa: E402
from unison.recipe.sweep.space import plan_sweep  # noqa: E402
from unison.recipe.sweep.study import tune  # noqa: E402


def _storage(folder: Path) -> str:
    return f"sqlite:///{folder / 'runs' / 'tiny' / 'tune-tiny' / 'study.db'}"


class FakeLaunch:
    """Returns trial results at once: the validation loss of each trial from ``values``; ``before``
    runs first (another process acting on the study meanwhile)."""

    def __init__(self, values: Iterator[float], before: Any = None) -> None:
        self.values = values
        self.before = before
        self.calls = 0

    def __call__(
        self,
        config: Any,
        planned: Any,
        resume: Any,
        nproc: Any,
        attach: Any,
        start_method: str = "spawn",
        quiet: bool = False,
    ) -> list:
        self.calls += 1
        if self.before is not None:
            self.before(self.calls)
        run_dir = planned.run_root / "20260101-000000"
        run_dir.mkdir(parents=True, exist_ok=True)
        value = next(self.values)
        return [{"run_dir": str(run_dir), "epochs": 1, "iterations": 4, "history": [{"val_loss": value}]}]


@pytest.fixture
def launch(monkeypatch) -> Any:
    def install(values: list[float] | Iterator[float], before: Any = None) -> FakeLaunch:
        fake = FakeLaunch(iter(values), before)
        monkeypatch.setattr(tune_module, "launch_config", fake)
        return fake

    return install


def test_a_fail_trial_is_replaced_until_the_study_holds_the_trials_asked_for(tmp_path: Path, launch) -> None:
    fake = launch([math.nan, 0.4, 0.3])
    out = tune(write_config(tmp_path), trials=2)
    assert counts_of(study_trials(tmp_path)) == {"FAIL": 1, "COMPLETE": 2} and fake.calls == 3
    assert out["short"] is None and out["best"]["value"] == 0.3
    failed = study_trials(tmp_path)[0]
    assert "no finite value" in failed.user_attrs["fail_reason"]


def test_the_count_is_read_from_the_study_after_every_trial(tmp_path: Path, launch) -> None:
    """Another process finishes a trial of the study while this one runs its first: with --trials 2
    the study holds 2 finished trials when this one ends (Optuna's MaxTrialsCallback semantics)."""

    def other_process(call: int) -> None:
        if call == 1:
            other = optuna.load_study(study_name="tiny", storage=_storage(tmp_path))
            other.add_trial(
                optuna.trial.create_trial(
                    params={LR: 0.5},
                    distributions={LR: optuna.distributions.CategoricalDistribution([0.0, 0.5])},
                    value=0.2,
                )
            )

    fake = launch([0.4, 0.3, 0.2], before=other_process)
    out = tune(write_config(tmp_path), trials=2)
    assert fake.calls == 1 and counts_of(study_trials(tmp_path)) == {"COMPLETE": 2}
    assert out["short"] is None


def test_a_study_left_short_exits_nonzero(tmp_path: Path, launch, capsys) -> None:
    fake = launch(iter(lambda: math.nan, None))
    assert main(["tune", str(write_config(tmp_path)), "--trials", "2"]) == 1
    assert fake.calls == 2 and counts_of(study_trials(tmp_path)) == {"FAIL": 2}
    assert "the study is short" in capsys.readouterr().err


def test_a_used_up_grid_ends_the_sweep_with_its_best_config(tmp_path: Path, launch) -> None:
    grid = f"tuning.sampler_kwargs={{search_space: {{{LR}: [0.0, 0.5]}}}}"
    path = write_config(tmp_path)
    path.write_text(
        path.read_text().replace("RandomSampler", "GridSampler").replace("  sampler_kwargs: {seed: 0}\n", "")
    )
    fake = launch([0.6, 0.3, 0.1])
    out = tune(path, trials=3, overrides=[grid])
    assert fake.calls == 2 and counts_of(study_trials(tmp_path)) == {"COMPLETE": 2}
    assert out["short"] is None and Path(out["best"]["config"]).is_file()
    again = tune(path, trials=3, overrides=[grid])  # nothing left to draw: nothing runs
    assert fake.calls == 2 and again["trials"] == []


@pytest.mark.timeout(60)
def test_a_killed_sweeps_running_trial_is_failed_and_its_values_asked_again(
    tmp_path: Path, launch, monkeypatch
) -> None:
    import unison.recipe.sweep.storage as storage_module

    monkeypatch.setattr(storage_module, "HEARTBEAT_S", 1)
    monkeypatch.setattr(storage_module, "GRACE_S", 1)
    config = write_config(tmp_path)
    plan = plan_sweep(config, [])
    plan.folder.mkdir(parents=True)
    killed = optuna.create_study(
        study_name="tiny", storage=storage_module.make_storage(plan.storage, plan.root)
    )
    lost = killed.ask()
    lost.suggest_categorical(LR, [0.0, 0.5])
    killed._storage.record_heartbeat(lost._trial_id)  # the sweep process is then SIGKILLed
    time.sleep(2.5)
    launch([0.25])
    tune(config, trials=1)
    first, retried = study_trials(tmp_path)
    assert (first.state.name, retried.state.name) == ("FAIL", "COMPLETE")
    assert retried.params == first.params and retried.value == 0.25


# -- tuning.storage: Optuna's storages, as its CLI maps them, and files kept inside the root ---------


@pytest.mark.parametrize(
    "storage",
    [
        "sqlite:////etc/study.db",
        "sqlite:///%2F..%2F..%2Fstudy.db",
        "sqlite:///a%252F..%252F..%252F..%252Fx.db",
        "../elsewhere/study.log",
        "/tmp/study.log",
        "sqlite:///../study.db",
    ],
)
def test_a_study_file_outside_the_output_root_is_refused(tmp_path: Path, storage: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_sweep(write_config(tmp_path), [f"tuning.storage={storage}"])
    assert info.value.key_path == "tuning.storage" and "output root" in str(info.value), str(info.value)
    assert not (tmp_path / "runs" / "tiny").exists()  # refused before the sweep made anything


def test_a_file_path_is_a_journal_file_inside_the_output_root(tmp_path: Path, launch) -> None:
    launch([0.3])
    out = tune(write_config(tmp_path), trials=1, overrides=["tuning.storage=sweeps/study.log"])
    journal = tmp_path / "runs" / "sweeps" / "study.log"
    assert journal.is_file() and out["counts"] == {"COMPLETE": 1}
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    assert optuna.load_study(study_name="tiny", storage=storage).best_value == 0.3


def test_a_relative_sqlite_url_is_a_file_in_the_output_root(tmp_path: Path, launch, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    launch([0.3])
    tune(write_config(tmp_path), trials=1, overrides=["tuning.storage=sqlite:///shared.db"])
    assert (tmp_path / "runs" / "shared.db").is_file() and not (tmp_path / "shared.db").exists()


def test_a_redis_url_is_optunas_journal_in_redis(tmp_path: Path, monkeypatch) -> None:
    from unison.config.tuning import storage_kind
    from unison.recipe.sweep.storage import make_storage

    assert [
        storage_kind(s) for s in ("redis://h:6379/0", "rediss://h", "postgresql://h/db", "study.log")
    ] == [
        "redis",
        "redis",
        "rdb",
        "journal",
    ]
    seen = []

    class Backend(optuna.storages.journal.JournalFileBackend):
        def __init__(self, url: str) -> None:
            seen.append(url)
            super().__init__(str(tmp_path / "stand-in.log"))

    monkeypatch.setattr(optuna.storages.journal, "JournalRedisBackend", Backend)
    storage = make_storage("redis://localhost:6379/0", tmp_path)
    assert isinstance(storage, optuna.storages.JournalStorage) and seen == ["redis://localhost:6379/0"]


# -- best.yaml: the search space's keys only -----------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["training.path", "name", "training.max_epochs=1\nname", "tuning.x"],
)
def test_best_yaml_applies_the_keys_of_the_search_space_only(tmp_path: Path, name: str) -> None:
    from unison.recipe.sweep.best import write_best

    plan = plan_sweep(write_config(tmp_path), [])
    plan.folder.mkdir(parents=True)
    study = optuna.create_study(study_name="tiny", storage=plan.storage)
    dist = optuna.distributions.CategoricalDistribution(["/elsewhere", 0.5])
    study.add_trial(
        optuna.trial.create_trial(
            params={LR: 0.5, name: "/elsewhere"},
            distributions={LR: optuna.distributions.CategoricalDistribution([0.0, 0.5]), name: dist},
            value=0.1,
        )
    )
    best = write_best(study, plan)
    assert best is not None
    text = best.read_text()
    config = load_config(best)
    assert config.training.path is None and config.name == "tiny" and config.training.max_epochs == 3
    assert "/elsewhere" not in text and config.training.optimizer_kwargs["lr"] == 0.5


def test_best_yaml_refuses_a_value_the_search_space_cannot_draw(tmp_path: Path) -> None:
    from unison.recipe.sweep.best import write_best

    plan = plan_sweep(write_config(tmp_path), [])
    plan.folder.mkdir(parents=True)
    study = optuna.create_study(study_name="tiny", storage=plan.storage)
    study.add_trial(
        optuna.trial.create_trial(
            params={LR: 7.0},
            distributions={LR: optuna.distributions.CategoricalDistribution([0.0, 7.0])},
            value=0.1,
        )
    )
    with pytest.raises(ConfigError, match="cannot draw") as info:
        write_best(study, plan)
    assert LR in str(info.value)


def test_a_search_space_key_that_is_no_identifier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a dotted config key"):
        load_config(
            write_config(tmp_path),
            ['tuning.search_space={"training.optimizer_kwargs.a=b": {type: float, low: 0.1, high: 1}}'],
        )


def test_a_study_file_in_the_output_root_serves_every_trial(tmp_path: Path, launch) -> None:
    """A SQLite file inside the output root but outside the sweep folder: the sweep accepts it, and
    its trials (each planned in a folder of its own) run with it instead of refusing it again."""
    shared = tmp_path / "runs" / "shared.db"
    fake = launch([0.4, 0.3])
    code = main(
        ["tune", str(write_config(tmp_path)), "--trials", "2", "--set", f"tuning.storage=sqlite:///{shared}"]
    )
    assert code == 0 and fake.calls == 2
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{shared}")
    assert counts_of(study.get_trials(deepcopy=False)) == {"COMPLETE": 2}
