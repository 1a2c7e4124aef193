"""unison/handlers/lr_scaling.py: the scaling rule, and a warmup that composes with any scheduler.

The truth for the warmup is the same run without it: the scheduler's values (what
``param_groups`` hold) must be the same, and the rate each step used must be that value
times ``min(1, k / steps)``. Resume exactness is in tests/handlers/test_ema.py (one run
checks both).
"""

from __future__ import annotations

import math

import pytest
import torch
from ignite.engine import Engine as IgniteEngine
from torch import nn
from torch.nn import functional as F

from unison.engine import Events, UpdateEvents, create_trainer
from unison.handlers import LRWarmup, scale_lr


@pytest.mark.parametrize(
    ("rule", "expected"), [("none", 0.1), ("linear", 0.1 * 96 / 32), ("sqrt", 0.1 * math.sqrt(3))]
)
def test_scale_lr_by_the_global_batch(rule: str, expected: float) -> None:
    assert scale_lr(0.1, rule, global_batch=96, reference_batch=32) == pytest.approx(expected)


def test_scale_lr_refuses_an_unknown_rule_and_empty_batches() -> None:
    with pytest.raises(ValueError, match=r"rule='cubic'.*none, linear, sqrt"):
        scale_lr(0.1, "cubic", 8, 8)
    with pytest.raises(ValueError, match="reference_batch=0"):
        scale_lr(0.1, "linear", 8, 0)


def _run(warmup: int | None, scheduler: str, accumulation: int = 2) -> tuple[list[float], list[float]]:
    """(rate each step used, the groups' lr after each update) of a small run."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    trainer = create_trainer(model, optimizer, F.mse_loss, accumulation_steps=accumulation)
    if scheduler == "step-per-update":
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        trainer.add_event_handler(UpdateEvents.UPDATE_COMPLETED, lambda e: sched.step())
    elif scheduler == "cosine-per-epoch":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: sched.step())
    if warmup is not None:
        LRWarmup(optimizer, warmup).attach(trainer)
    used: list[float] = []
    groups: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    trainer.add_event_handler(
        UpdateEvents.UPDATE_COMPLETED, lambda e: groups.append(optimizer.param_groups[0]["lr"])
    )
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(6)]
    trainer.run(data, max_epochs=3)
    return used, groups


@pytest.mark.parametrize("scheduler", ["none", "step-per-update", "cosine-per-epoch"])
def test_warmup_multiplies_the_schedule_and_leaves_it_alone(scheduler: str) -> None:
    plain_used, plain_groups = _run(None, scheduler)
    used, groups = _run(4, scheduler)
    assert len(used) == 9  # 3 epochs x 3 updates (accumulation 2 over 6 micro-batches)
    assert groups == plain_groups  # the scheduler never sees the factor
    assert used == [lr * min(1.0, k / 4) for k, lr in enumerate(plain_used, start=1)]
    assert used[:4] != plain_used[:4] and used[4:] == plain_used[4:]


def test_warmup_of_zero_steps_changes_nothing() -> None:
    assert _run(0, "step-per-update") == _run(None, "step-per-update")


def test_bad_arguments_and_engines_are_refused() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"LRWarmup\(steps=-1\): expected an int >= 0"):
        LRWarmup(optimizer, -1)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        LRWarmup(nn.Linear(2, 1), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="counts no optimizer updates"):
        LRWarmup(optimizer, 3).attach(IgniteEngine(lambda e, b: None))


def test_detach_removes_the_warmup() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, F.mse_loss)
    warmup = LRWarmup(optimizer, 10)
    warmup.attach(trainer)
    warmup.detach()
    used: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: used.append(opt.param_groups[0]["lr"]))
    trainer.run([(torch.ones(1, 2), torch.ones(1, 1))] * 2)
    assert used == [0.1, 0.1] and not trainer.has_event_handler(warmup._on_started, Events.STARTED)
