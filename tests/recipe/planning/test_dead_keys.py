"""unison/recipe/planning/dead_keys.py: arguments of an object the config does not build are refused, by a run
and by a sweep's search space, before anything is spawned, naming the file, the line and the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sweep"))  # the sweep tests' config writer
from test_study import LR, write_config  # noqa: E402

from unison.config import ConfigError, load_config  # noqa: E402
from unison.recipe.phases import run
from unison.recipe.planning.dead_keys import changes_nothing, unowned  # noqa: E402
from unison.recipe.planning.resolved import resolve

OPTIMIZER = "  optimizer_kwargs: {lr: 0.5}\n"


def _with(tmp_path: Path, training: str = "", extra: str = "", space: str = "") -> Path:
    path = write_config(tmp_path, extra=extra, space=space)
    path.write_text(path.read_text().replace(OPTIMIZER, OPTIMIZER + training))
    return path


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    ("training", "extra", "key"),
    [
        ("  scheduler_kwargs: {gamma: 0.5}\n", "", "training.scheduler_kwargs"),
        ("", "early_stopping:\n  kwargs: {verbose: true}\n", "early_stopping.kwargs"),
    ],
)
def test_a_run_refuses_arguments_of_an_object_it_does_not_build(
    tmp_path: Path, training: str, extra: str, key: str
) -> None:
    path = _with(tmp_path, training, extra)
    config = load_config(path)  # the schema takes it: a saved run's config.yaml still reads
    with pytest.raises(ConfigError, match="changes nothing") as info:
        run(path, nproc=1)
    err = info.value
    assert err.key_path == key and err.line == _line(path, (training or extra).splitlines()[-1]), str(err)
    assert f"{path}:{err.line}" in str(err) and "not set" in str(err)
    assert not (tmp_path / "runs").exists()  # refused before any rank is spawned
    assert unowned(config) is not None


def test_scheduler_kwargs_with_their_scheduler_resolve(tmp_path: Path) -> None:
    training = (
        "  scheduler_type: !pyobject torch.optim.lr_scheduler.StepLR\n  scheduler_kwargs: {step_size: 1}\n"
    )
    resolved = resolve(load_config(_with(tmp_path, training)))
    assert resolved.scheduler_kwargs == {"step_size": 1}


@pytest.mark.parametrize(
    ("training", "space", "key", "says"),
    [
        (
            "",
            "    training.scheduler_kwargs.gamma: {type: float, low: 0.1, high: 0.9}\n",
            "training.scheduler_kwargs.gamma",
            "training.scheduler_type is not set",
        ),
        (
            "",
            "    early_stopping.min_delta: {type: float, low: 0.0, high: 0.1}\n",
            "early_stopping.min_delta",
            "early_stopping.patience is not set",
        ),
        ("  lr: 0.1\n", "", LR, "training.lr is set (0.1) and replaces it"),
    ],
)
def test_a_search_space_key_that_changes_nothing_is_refused_before_any_trial(
    tmp_path: Path, training: str, space: str, key: str, says: str
) -> None:
    from unison.recipe.sweep.space import plan_sweep

    path = _with(tmp_path, training, space=space)
    with pytest.raises(ConfigError, match="changes nothing") as info:
        plan_sweep(path, [])
    err = info.value
    assert err.key_path == f"tuning.search_space.{key}" and says in str(err), str(err)
    assert err.line == _line(path, f"    {key}:") and f"{path}:{err.line}" in str(err)
    assert not (tmp_path / "runs").exists()


def test_a_search_space_key_with_its_owner_set_is_taken(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from unison.recipe.sweep.space import plan_sweep

    training = (
        "  scheduler_type: !pyobject torch.optim.lr_scheduler.StepLR\n  scheduler_kwargs: {step_size: 1}\n"
    )
    space = "    training.scheduler_kwargs.gamma: {type: float, low: 0.1, high: 0.9}\n"
    plan = plan_sweep(_with(tmp_path, training, space=space), [])
    assert "training.scheduler_kwargs.gamma" in plan.space
    assert changes_nothing(plan.config, "training.scheduler_kwargs.gamma") is None
