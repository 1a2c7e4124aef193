"""unison/recipe/build/assemble.py: the steps that build a run from its plan, one at a time, in one process.

Each step takes the plan (and what earlier steps built) and is called here on its own; a run
whose plan has no config to read still builds, trains and tests.
Training a run built in steps is in tests/cli/test_run.py; real runs of whole configs,
spawned on 2 ranks, are in tests/cli/test_cli.py and tests/recipes/.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli_parts import config, datasets, parts_of, planned, resolved, tiny_datasets
from torch.nn import functional as F

from unison.config import ConfigError
from unison.config.schema import EMAConfig
from unison.engine import TrainStep
from unison.recipe.build.assemble import (
    build_datasets,
    build_evaluator,
    build_loaders,
    build_model,
    build_optimizer,
    build_run,
    build_trainer,
)
from unison.recipe.build.checkpointing import checkpoint_objects
from unison.recipe.build.finish import evaluate_test_set

# -- data --------------------------------------------------------------------------------------


def test_validation_loader_takes_the_validation_sections_num_workers() -> None:
    """The fix: validation.num_workers was ignored, and training.num_workers used for both loaders."""
    c = config()
    c.training.num_workers = 0
    c.validation.num_workers = 1
    train_loader, val_loader = build_loaders(planned(c), datasets())
    assert train_loader is not None and val_loader is not None
    assert (train_loader.num_workers, val_loader.num_workers) == (0, 1)


@pytest.mark.parametrize("shuffle", [True, False])
def test_training_shuffle_reaches_the_training_sampler(shuffle: bool) -> None:
    """QuantumGrav's training.shuffle: False keeps the dataset's order, epoch after epoch."""
    c = config()
    c.training.shuffle = shuffle
    train_loader, _ = build_loaders(planned(c), datasets())
    assert train_loader is not None
    orders = []
    for epoch in range(2):
        train_loader.sampler.set_epoch(epoch)
        orders.append(list(train_loader.sampler))
    in_order = list(range(len(orders[0])))
    assert (orders == [in_order, in_order]) is not shuffle


def test_training_workers_stay_with_the_training_loader() -> None:
    """training.num_workers and prefetch_factor are the training loader's; validation has no workers."""
    c = config()
    c.training.num_workers = 2
    c.training.prefetch_factor = 3
    c.validation.num_workers = 0
    train_loader, val_loader = build_loaders(planned(c), datasets())
    assert train_loader is not None and val_loader is not None
    assert (train_loader.num_workers, train_loader.prefetch_factor) == (2, 3)
    assert (val_loader.num_workers, val_loader.prefetch_factor) == (0, None)


def test_validation_workers_prefetch_as_training_asks() -> None:
    c = config()
    c.training.num_workers = 1
    c.training.prefetch_factor = 3
    c.training.pin_memory = True
    c.validation.num_workers = 2
    _, val_loader = build_loaders(planned(c), datasets())
    assert val_loader is not None
    assert (val_loader.num_workers, val_loader.prefetch_factor, val_loader.pin_memory) == (2, 3, True)


@pytest.mark.parametrize(("val_batch", "expected"), [(None, 4), (5, 5)])
def test_validation_batch_size_defaults_to_the_training_one(val_batch: int | None, expected: int) -> None:
    c = config()
    c.validation.batch_size = val_batch
    train_loader, val_loader = build_loaders(planned(c), datasets())
    assert train_loader is not None and val_loader is not None
    assert (train_loader.batch_size, val_loader.batch_size) == (4, expected)


def test_build_datasets_takes_two_or_three_datasets() -> None:
    two = build_datasets(planned(config(), resolved(data_kwargs={"test": False})))
    assert two.test is None and len(two.train) == 12 and len(two.val) == 6
    three = build_datasets(planned(config(), resolved()))
    assert three.test is not None and len(three.test) == 6


def test_build_datasets_refuses_anything_else() -> None:
    with pytest.raises(TypeError, match=r"data.build must return \(train, val\) or \(train, val, test\)"):
        build_datasets(planned(config(), resolved(data_build=lambda seed: tiny_datasets(seed)[0])))


def test_build_datasets_seeds_before_building() -> None:
    def draw(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(3), torch.rand(3)  # the global generator, seeded by the step

    first = build_datasets(planned(config(), resolved(data_build=draw)))
    second = build_datasets(planned(config(), resolved(data_build=draw)))
    assert torch.equal(first.train, second.train)


# -- model, optimizer and scheduler -----------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "world", "expected"), [("none", 4, 0.5), ("linear", 4, 2.0), ("sqrt", 4, 1.0)]
)
def test_training_lr_overrides_the_optimizer_kwargs_then_scales(
    rule: str, world: int, expected: float
) -> None:
    c = config()
    c.training.lr = 0.5
    c.training.lr_scaling = rule  # type: ignore[assignment]
    model = build_model(planned(c))
    optimizer, scheduler = build_optimizer(planned(c), model, world)
    assert isinstance(optimizer, torch.optim.SGD) and scheduler is None
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def test_build_optimizer_makes_the_scheduler_of_the_optimizer() -> None:
    r = resolved(scheduler_type=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 2})
    model = build_model(planned(config(), r))
    optimizer, scheduler = build_optimizer(planned(config(), r), model, 1)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.optimizer is optimizer


# -- trainer -----------------------------------------------------------------------------------


def test_the_trainer_steps_as_the_training_section_asks() -> None:
    c = config()
    c.training.accumulation_steps = 2
    c.training.clip_grad_norm = 1.5
    r = resolved()
    model = build_model(planned(c, r))
    optimizer, _ = build_optimizer(planned(c, r), model, 1)
    step = build_trainer(planned(c, r), model, optimizer).process_function
    assert isinstance(step, TrainStep)
    assert (step.optimizer, step.loss_fn, step.accumulation_steps, step.clip_grad_norm) == (
        optimizer,
        F.cross_entropy,
        2,
        1.5,
    )
    assert step.amp_dtype is None and step.scaler is None


# -- evaluator ---------------------------------------------------------------------------------


def test_the_watched_metric_defaults_to_the_first() -> None:
    model = build_model(planned(config()))
    _, watched = build_evaluator(planned(config()), model)
    assert watched == "accuracy"


def test_an_unknown_checkpoint_metric_is_a_config_error() -> None:
    c = config()
    c.checkpoint.metric = "f1"
    model = build_model(planned(c))
    with pytest.raises(ConfigError, match="no validation metric named 'f1'"):
        build_evaluator(planned(c), model)


# -- handlers ----------------------------------------------------------------------------------


def test_checkpoint_holds_model_optimizer_scheduler_and_early_stopping(tmp_path: Path) -> None:
    c = config(tmp_path)
    c.early_stopping.patience = 2
    r = resolved(scheduler_type=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 1})
    parts = parts_of(c, r, tmp_path)
    assert list(checkpoint_objects(parts)) == ["model", "optimizer", "scheduler"]
    assert parts.checkpoint is not None
    assert list(parts.checkpoint.to_save) == ["model", "optimizer", "scheduler", "early_stopping"]


@pytest.mark.parametrize(("every", "steps"), [("epoch", 2), ("update", 4)])
def test_the_scheduler_steps_per_epoch_or_per_optimizer_update(
    tmp_path: Path, every: str, steps: int
) -> None:
    """12 training samples in batches of 4, 2 micro-batches per update: each epoch is 3 iterations
    and 2 updates (the last window is short), so 2 epochs are 2 scheduler steps or 4."""
    c = config()
    c.training.max_epochs = 2
    c.training.accumulation_steps = 2
    c.training.scheduler_every = every  # type: ignore[assignment]  # a Literal set from a str
    r = resolved(
        scheduler_type=torch.optim.lr_scheduler.StepLR, scheduler_kwargs={"step_size": 1, "gamma": 0.5}
    )
    parts = parts_of(c, r, tmp_path)
    parts.trainer.run(parts.train_loader, max_epochs=2)
    assert parts.trainer.state.update == 4
    assert parts.scheduler.last_epoch == steps
    assert parts.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**steps)


# -- the plan alone ------------------------------------------------------------------------------


def test_a_run_builds_trains_and_tests_from_the_plan_alone(tmp_path: Path) -> None:
    """Every build step and attacher, and the test split, read the plan (which holds no config:
    tests/recipe/test_config_takers.py): with every handler the config can turn on (checkpoint, early
    stopping, EMA, TensorBoard and its HParams, the watchdog, the time limit), the plan builds, trains
    and tests."""
    c = config(tmp_path)
    c.training.max_epochs = 2
    c.training.ema = EMAConfig(decay=0.5)
    c.training.time_limit = 600.0
    c.training.hang_timeout = 600.0
    c.early_stopping.patience = 3
    c.logging.tensorboard = True
    c.testing.batch_size = 5
    alone = planned(c)
    parts = build_run(alone, tmp_path, world_size=1)
    parts.trainer.run(parts.train_loader, max_epochs=alone.trainer.max_epochs)
    assert [row["epoch"] for row in parts.history] == [1, 2]
    assert parts.checkpoint is not None and parts.checkpoint.best is not None
    assert parts.checkpoint.to_save["early_stopping"] is not None
    test = evaluate_test_set(alone, parts)
    assert set(test) == {"accuracy", "loss"}
    assert list((tmp_path / "tb").glob("events.*"))


# -- one attacher per concern --------------------------------------------------------------------


def test_each_concern_is_one_attacher_taken_in_order(tmp_path: Path) -> None:
    """The build attaches one concern per function, in a fixed order (the checkpoint after every
    handler with a state); each can be called on its own, and attaches that concern only."""
    from unison.recipe.build.assemble import ATTACHERS, build_parts
    from unison.recipe.build.checkpointing import attach_checkpoint

    assert [a.__name__ for a in ATTACHERS] == [
        "attach_validation",
        "attach_scheduler",
        "attach_early_stopping",
        "attach_guards",
        "attach_checkpoint",
        "attach_tensorboard",
        "attach_hparams",
        "attach_profiler",
        "attach_tracking",
        "attach_wandb",
        "attach_progress",
    ]
    c = config(tmp_path)
    c.early_stopping.patience = 2
    p = planned(c)
    parts = build_parts(p, 1)
    attach_checkpoint(p, parts, tmp_path)  # alone: early stopping was not attached, so it is not held
    assert parts.checkpoint is not None and list(parts.checkpoint.to_save) == ["model", "optimizer"]
    assert parts.early_stopping is None and parts.history == []
