"""unison/recipe/planning/run_plan.py: one pass from a config to the plan of its run, each derived value once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import unison.metrics
import unison.recipe.planning.early_stop
from unison.config import load_config
from unison.recipe import RunPlan, plan
from unison.recipe.build.assemble import build_run

DATA = """\
import torch
from torch.utils.data import TensorDataset


def build(seed, n=16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x[:8], y[:8]), TensorDataset(x[8:], y[8:])
"""

BODY = """\
name: tiny
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject plandata.build
training:
  max_epochs: 1
  batch_size: 4
  amp: bf16
  compile: false
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
    accuracy: !pyobject unison.metrics.Accuracy
checkpoint:
  metric: accuracy
  mode: max
  preemption: false
early_stopping:
  patience: 2
"""


def _config_file(folder: Path) -> Path:
    (folder / "plandata.py").write_text(DATA)
    path = folder / "c.yaml"
    path.write_text(BODY + f"logging:\n  root: {folder / 'runs'}\n  progress: false\n  tensorboard: false\n")
    return path


def _derived(p: RunPlan) -> dict[str, object]:
    """The plan's derived values (everything but the config and the objects it names)."""
    skip = {"config", "resolved", "early_stopping"}
    values: dict[str, object] = {
        f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in skip
    }
    es = p.early_stopping
    values["early_stopping"] = None if es is None else (es.cls, es.args, es.kwargs)
    return values


def test_the_watched_metric_is_derived_once_for_checkpoints_and_early_stopping(tmp_path: Path) -> None:
    p = plan(load_config(_config_file(tmp_path)))
    w = p.watched
    assert (w.metric, w.mode, w.stop_metric, w.stop_mode) == ("accuracy", "max", "accuracy", "max")
    assert p.early_stopping is not None
    assert (p.early_stopping.kwargs["metric"], p.early_stopping.kwargs["mode"]) == ("accuracy", "max")
    assert p.amp == "bf16" and p.model.compile is False and p.model.fsdp is None and p.tracking is None
    assert (
        p.root == tmp_path / "runs"
        and p.root_key == "logging.root"
        and p.run_root == tmp_path / "runs" / "tiny"
    )


def test_early_stopping_is_resolved_once_for_a_plan_and_its_built_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's class is looked up when the run is planned, and the rank builds from the plan."""
    looked_up: list[str] = []
    find = unison.recipe.planning.early_stop._handler_class
    monkeypatch.setattr(
        unison.recipe.planning.early_stop, "_handler_class", lambda *a: looked_up.append("es") or find(*a)
    )
    p = plan(load_config(_config_file(tmp_path), ["training.amp=none"]))
    parts = build_run(p, tmp_path / "run", world_size=1)
    assert looked_up == ["es"]
    assert parts.checkpoint is not None and parts.checkpoint.metric == p.watched.metric == parts.watched
    stopper = parts.checkpoint.to_save["early_stopping"]
    assert (stopper.metric, stopper.checker.mode) == (p.watched.stop_metric, p.watched.stop_mode)


def test_planning_again_gives_the_same_plan_and_writes_nothing(tmp_path: Path) -> None:
    """A spawned rank plans again from the config: the same values, and nothing written."""
    path = _config_file(tmp_path)
    first, again = (
        plan(load_config(path, ["logging.mlflow={}"])),
        plan(load_config(path, ["logging.mlflow={}"])),
    )
    assert _derived(first) == _derived(again)
    assert (
        first.tracking is not None
        and first.tracking[0] == f"sqlite:///{(tmp_path / 'runs').resolve()}/mlflow.db"
    )
    assert not (tmp_path / "runs").exists()


def test_a_changed_checkpoint_mode_moves_early_stopping_with_it(tmp_path: Path) -> None:
    config = load_config(_config_file(tmp_path), ["checkpoint.mode=min", "checkpoint.metric=loss"])
    p = plan(config)
    assert (p.watched.stop_metric, p.watched.stop_mode) == ("loss", "min")
    config = load_config(_config_file(tmp_path), ["early_stopping.metric=loss", "early_stopping.mode=min"])
    w = plan(config).watched
    assert (w.metric, w.mode, w.stop_metric, w.stop_mode) == ("accuracy", "max", "loss", "min")


def test_the_resume_base_and_the_loss_rule_are_planned_once(tmp_path: Path) -> None:
    """The learning rate a resume compares with the checkpoint's, at the planned world size, and the
    metrics each evaluation builds (a ``Loss`` without ``loss_fn`` gets the training loss) are plan
    values: the build reads them, never the config."""
    config = load_config(
        _config_file(tmp_path),
        ["training.lr=0.1", "training.lr_scaling=linear", "training.optimizer_kwargs={weight_decay: 0.5}"],
    )
    p = plan(config, world_size=2)
    assert p.resume.lr == pytest.approx(0.2)  # 0.1 at one rank, linear in the world size
    assert p.resume.optimizer_kwargs == {"weight_decay": 0.5} and p.resume.scheduler_kwargs == {}
    validation = p.metrics["validation"]
    assert sorted(validation) == ["accuracy", "loss"]
    cls, kwargs = validation["loss"]
    assert cls is unison.metrics.Loss and kwargs["loss_fn"] is p.resolved.loss
    assert sorted(p.metrics["testing"]) == ["accuracy", "loss"]


def test_the_plan_builds_its_locator_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``_References`` per plan: resolving, the trackers' checks, early stopping and the user's
    handlers take the plan's, and the run after it reads ``RunPlan.refs``."""
    from unison.recipe.planning.references import _References

    built: list[object] = []
    of = _References.of.__func__  # type: ignore[attr-defined]

    def counted(cls: type, config: object) -> object:
        built.append(config)
        return of(cls, config)

    monkeypatch.setattr(_References, "of", classmethod(counted))
    config = load_config(_config_file(tmp_path), ["logging.mlflow={}"])
    p = plan(config)
    assert len(built) == 1 and p.refs.origin is config.origin
