"""The one stop path (unison/engine/control.py): every kind of stop is decided and applied
alike, with the same boundary rule at world size 1 and N."""

from __future__ import annotations

import io

import pytest
import torch

from unison.distributed import get_rank
from unison.engine import Engine, Events, create_trainer
from unison.engine.control import StopControl
from unison.testing import run_distributed

K = 4  # accumulation steps


def _trainer(sync_every: int = 1) -> tuple[Engine, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(
        model, optimizer, torch.nn.functional.mse_loss, accumulation_steps=K, sync_every=sync_every
    )
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(3 * K)]
    return trainer, data


def _stop_mid_window(how: str, at: int, asking_rank: int) -> tuple[int, int, bool]:
    trainer, data = _trainer()

    def ask(engine: Engine) -> None:
        if get_rank() == asking_rank:
            getattr(engine, how)(*(("asked mid-window",) if how == "request_stop" else ()))

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=at), ask)
    state = trainer.run(data, max_epochs=2)
    return state.iteration, state.epoch, trainer.process_function.at_boundary(trainer)


@pytest.mark.parametrize("how", ["request_stop", "terminate", "terminate_epoch"])
def test_world_size_1_never_stops_inside_an_accumulation_window(how: str) -> None:
    iteration, epoch, at_boundary = _stop_mid_window(how, at=2, asking_rank=0)
    assert at_boundary
    if how == "terminate_epoch":
        assert (iteration, epoch) == (K + 3 * K, 2)  # epoch 1 ends after the window, epoch 2 runs whole
    else:
        assert (iteration, epoch) == (K, 1)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["request_stop", "terminate"])
def test_the_boundary_is_the_same_at_world_size_1_and_2(how: str) -> None:
    alone = _stop_mid_window(how, at=2, asking_rank=0)
    results = run_distributed(_stop_mid_window, how, 2, 1, nproc=2, timeout=100)
    assert results == [alone, alone]


def _interrupt_on_rank_1() -> tuple[list[int], int]:
    engine = Engine(lambda e, b: torch.tensor(1.0), sync_every=2)
    engine.add_event_handler(
        Events.ITERATION_COMPLETED(once=3), lambda e: e.interrupt() if get_rank() == 1 else None
    )
    interrupted: list[int] = []
    engine.add_event_handler(Events.INTERRUPT, lambda e: interrupted.append(e.state.iteration))
    engine.run(range(10), max_epochs=1)
    state = engine.run(range(10), max_epochs=1)  # continues where the pause left off
    return interrupted, state.iteration


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_interrupt_on_one_rank_pauses_every_rank_at_one_iteration() -> None:
    results = run_distributed(_interrupt_on_rank_1, nproc=2, timeout=100)
    assert results == [([4], 10), ([4], 10)]  # asked at 3, agreed at the sync point of iteration 4


def test_interrupt_at_world_size_1_is_ignites() -> None:
    engine = Engine(lambda e, b: None)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=3), lambda e: e.interrupt())
    assert engine.run(range(10)).iteration == 3
    assert engine.run(range(10)).iteration == 10


def test_precedence_stop_then_interrupt_then_epoch() -> None:
    control = StopControl("t")
    control.request("epoch", "e")
    control.request("interrupt", "i")
    control.load_synced_state(control.sync_state())
    assert control.decision is not None and control.decision.kind == "interrupt"
    control.request("stop", "s", skip_completed=True)
    control.load_synced_state(control.sync_state())
    assert control.decision.kind == "stop" and control.decision.skip_completed


def test_an_agreed_stop_overrides_an_epoch_request() -> None:
    engine = Engine(lambda e, b: None, sync_every=None)
    events: list[str] = []
    engine.add_event_handler(Events.TERMINATE, lambda e: events.append("TERMINATE"))
    engine.add_event_handler(Events.TERMINATE_SINGLE_EPOCH, lambda e, *_: events.append("EPOCH"))
    control = engine._control
    control.request("epoch", "end it")
    control.agree("guard")
    control.load_synced_state(control.sync_state())
    engine.state.iteration, engine.state.epoch = 1, 1
    assert control.apply(engine)
    assert engine.should_terminate and not engine.should_terminate_single_epoch
    assert not control.pending


def test_pending_requests_round_trip_through_weights_only() -> None:
    control = StopControl("t")
    control.request("stop", "a")
    control.request("interrupt", "b")
    buffer = io.BytesIO()
    torch.save(control.state_dict(), buffer)
    other = StopControl("t")
    other.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert other.requests == control.requests and other.requested


def _saved_requests(at: int, sync_every: int) -> list[str]:
    """The stop requests an engine's state_dict holds when taken right after a request at ``at``."""
    engine = Engine(lambda e, b: None, sync_every=sync_every)
    saved: list[str] = []

    @engine.on(Events.ITERATION_COMPLETED(once=at))
    def ask_then_save(engine: Engine) -> None:
        engine.request_stop("asked")
        saved.extend(engine.extra_state_dict()["stop"]["reasons"])

    engine.run(range(10))
    return saved


def _saved_in_three_places() -> dict[str, list[str]]:
    return {
        "at a sync point": _saved_requests(at=4, sync_every=2),
        "between sync points": _saved_requests(at=3, sync_every=2),
        "at the epoch's end": _saved_requests(at=10, sync_every=4),
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_checkpoint_holds_only_requests_no_sync_point_has_settled() -> None:
    """A request the sync point of this very iteration settles was acted on by the saved run:
    the resumed run must not stop again for it. One still waiting for a sync point is kept."""
    results = run_distributed(_saved_in_three_places, nproc=2, timeout=100)
    for saved in results:
        assert saved == {"at a sync point": [], "between sync points": ["asked"], "at the epoch's end": []}
