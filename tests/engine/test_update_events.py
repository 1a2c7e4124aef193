"""UpdateEvents.UPDATE_COMPLETED: the optimizer's clock, once per accumulation window."""

from __future__ import annotations

import io

import pytest
import torch

from unison.engine import Engine, Events, UpdateEvents, create_trainer


def _data(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=g), torch.randn(2, 1, generator=g)) for _ in range(n)]


def _trainer(k: int, event: object, lr_every: int = 1) -> tuple[Engine, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_every, gamma=0.5)
    trainer = create_trainer(model, optimizer, torch.nn.functional.mse_loss, accumulation_steps=k)
    trainer.add_event_handler(event, lambda e: scheduler.step())
    return trainer, scheduler


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_scheduler_on_updates_matches_the_run_without_accumulation(k: int) -> None:
    updates = 12 // k
    accumulated, acc_scheduler = _trainer(k, UpdateEvents.UPDATE_COMPLETED)
    accumulated.run(_data(), max_epochs=1)
    plain, plain_scheduler = _trainer(1, Events.ITERATION_COMPLETED)
    plain.run(_data(updates), max_epochs=1)
    assert accumulated.state.update == plain.state.update == updates
    assert acc_scheduler.get_last_lr() == plain_scheduler.get_last_lr() == [0.5**updates]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_on_iterations_a_scheduler_steps_per_micro_batch() -> None:
    """Why the event exists: ITERATION_COMPLETED under accumulation is the micro-batch clock."""
    trainer, scheduler = _trainer(4, Events.ITERATION_COMPLETED)
    trainer.run(_data(), max_epochs=1)
    assert scheduler.get_last_lr() == [0.5**12] and trainer.state.update == 3


def test_a_short_last_window_is_an_update_and_filters_count_updates() -> None:
    trainer, _ = _trainer(4, UpdateEvents.UPDATE_COMPLETED)
    seen: list[tuple[int, int]] = []
    trainer.add_event_handler(
        UpdateEvents.UPDATE_COMPLETED(every=2), lambda e: seen.append((e.state.update, e.state.iteration))
    )
    trainer.run(_data(10), max_epochs=2)  # windows of 4, 4, 2 per epoch
    assert trainer.state.update == 6
    assert seen == [(2, 8), (4, 14), (6, 20)]


def test_the_update_count_is_saved_restored_and_reset_by_a_fresh_run() -> None:
    trainer, _ = _trainer(2, UpdateEvents.UPDATE_COMPLETED)
    trainer.run(_data(), max_epochs=1)
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    other, _ = _trainer(2, UpdateEvents.UPDATE_COMPLETED)
    other.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert other.state.update == 6
    other.run(_data(), max_epochs=2)
    assert other.state.update == 12
    trainer.run(_data(), max_epochs=1)  # done: ignite starts a fresh run
    assert trainer.state.update == 6


def test_a_plain_engine_knows_the_event() -> None:
    engine = Engine(lambda e, b: None)
    fired: list[int] = []
    engine.add_event_handler(UpdateEvents.UPDATE_COMPLETED, lambda e: fired.append(1))
    engine.run(range(3))
    assert fired == [] and engine.state.update == 0
