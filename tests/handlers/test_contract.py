"""The contract every public handler keeps: attach twice harmlessly, round-trip its state,
and run the same at world size 1 and 2."""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import unison.handlers as handlers
from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers import (
    EMA,
    AgreedPruning,
    Checkpoint,
    EarlyStopping,
    HParamsLogger,
    LRWarmup,
    MLflowLogger,
    NonFiniteGuard,
    Preemption,
    Profiler,
    ProgressBar,
    TensorBoardLogger,
    TimeLimit,
    Watchdog,
)
from unison.metrics import EpochAverage, Loss, MetricGroup
from unison.testing import run_distributed


def _trainer() -> tuple[Engine, Engine, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, torch.nn.functional.mse_loss, sync_every=2)
    evaluator = create_evaluator(model, {"loss": Loss(torch.nn.functional.mse_loss)})
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run(data[:2]))
    return trainer, evaluator, data


# name -> fn(trainer, evaluator, folder) -> (handler, attach(handler))
FACTORIES: dict[str, Callable[[Engine, Engine, Path], tuple[Any, Callable[[Any], None]]]] = {
    "EpochAverage": lambda t, e, d: (EpochAverage("second_loss"), lambda h: h.attach(t)),
    "ProgressBar": lambda t, e, d: (ProgressBar(file=io.StringIO()), lambda h: h.attach(t)),
    "EarlyStopping": lambda t, e, d: (
        EarlyStopping(t, "loss", patience=2, mode="min"),
        lambda h: h.attach(e),
    ),
    "NonFiniteGuard": lambda t, e, d: (NonFiniteGuard(), lambda h: h.attach(t)),
    "AgreedPruning": lambda t, e, d: (
        AgreedPruning(t, "loss", lambda value, step: None),
        lambda h: h.attach(e),
    ),
    "EMA": lambda t, e, d: (EMA(t.process_function.model, decay=0.9), lambda h: h.attach(t)),
    "LRWarmup": lambda t, e, d: (LRWarmup(t.process_function.optimizer, 3), lambda h: h.attach(t)),
    "TimeLimit": lambda t, e, d: (TimeLimit(3600), lambda h: h.attach(t)),
    "Watchdog": lambda t, e, d: (Watchdog(3600, stream=io.StringIO()), lambda h: h.attach(t)),
    "Checkpoint": lambda t, e, d: (
        Checkpoint(d / "ckpt", {"model": t.process_function.model}, t, keep_last=1),
        lambda h: h.attach(),
    ),
    "Preemption": lambda t, e, d: (
        Preemption(Checkpoint(d / "pre", {"model": t.process_function.model}, t)),
        lambda h: h.attach(t),
    ),
    "TensorBoardLogger": lambda t, e, d: (
        TensorBoardLogger(d / "tb", trainer=t, evaluators={"val": e}),
        lambda h: h.attach(),
    ),
    "HParamsLogger": lambda t, e, d: (
        HParamsLogger(d / "hp", {"training.lr": 0.1, "model.type": "Linear"}, trainer=t),
        lambda h: h.attach(),
    ),
    "Profiler": lambda t, e, d: (Profiler(d / "prof", wait=0, warmup=1, active=1), lambda h: h.attach(t)),
    "MLflowLogger": lambda t, e, d: (
        MLflowLogger(f"sqlite:///{d / 'mlflow.db'}", trainer=t, experiment="contract", evaluators={"val": e}),
        lambda h: h.attach(),
    ),
    "MetricGroup": lambda t, e, d: (
        MetricGroup({"extra": Loss(torch.nn.functional.mse_loss)}),
        lambda h: h.attach(e),
    ),
}


def test_every_public_handler_is_covered() -> None:
    public = {
        name
        for name in handlers.__all__
        if isinstance(getattr(handlers, name), type)
        and name not in {"EarlyStopChecker", "SyncedHandler"}  # a checker and a base class
    }
    assert public <= set(FACTORIES), f"handlers without a contract test: {sorted(public - set(FACTORIES))}"


def _registrations(*engines: Engine) -> int:
    return sum(len(h) for engine in engines for h in engine._event_handlers.values())


def _sync_contributors(*engines: Engine) -> int:
    return sum(len(engine.sync_point.contributors()) for engine in engines)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_attaching_twice_registers_once(name: str, tmp_path: Path) -> None:
    trainer, evaluator, data = _trainer()
    handler, attach = FACTORIES[name](trainer, evaluator, tmp_path)
    attach(handler)
    once = (_registrations(trainer, evaluator), _sync_contributors(trainer, evaluator))
    attach(handler)
    assert (_registrations(trainer, evaluator), _sync_contributors(trainer, evaluator)) == once
    state = trainer.run(data, max_epochs=2)
    assert state.iteration == 10


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_running_twice_keeps_registrations_and_counts(name: str, tmp_path: Path) -> None:
    """A handler survives a second run() of the same engine: nothing is registered again, no
    state of the first run leaks into the second (a stop, a pending save, a started clock)."""
    trainer, evaluator, data = _trainer()
    handler, attach = FACTORIES[name](trainer, evaluator, tmp_path)
    attach(handler)
    first = trainer.run(data, max_epochs=2)
    assert (first.iteration, first.epoch) == (10, 2)
    registered = (_registrations(trainer, evaluator), _sync_contributors(trainer, evaluator))
    syncs = trainer.sync_point.count
    second = trainer.run(data, max_epochs=3)  # ignite continues a finished run to the new max_epochs
    assert (second.iteration, second.epoch) == (15, 3)
    assert (_registrations(trainer, evaluator), _sync_contributors(trainer, evaluator)) == registered
    assert trainer.sync_point.count > syncs  # the second run synced again, with the same contributors
    assert not trainer.stop_requested


STATEFUL = sorted(name for name in FACTORIES if hasattr(getattr(handlers, name, MetricGroup), "state_dict"))
COLLECTIVE_TIMEOUT_S = 240
"""How long a rank waits in a collective before failing, in the one-rank-attached tests."""


def test_stateful_handlers_are_the_expected_ones() -> None:
    assert {"Checkpoint", "EarlyStopping"} <= set(STATEFUL)


@pytest.mark.parametrize("name", STATEFUL)
def test_state_dict_round_trip(name: str, tmp_path: Path) -> None:
    trainer, evaluator, data = _trainer()
    handler, attach = FACTORIES[name](trainer, evaluator, tmp_path)
    attach(handler)
    trainer.run(data, max_epochs=2)
    saved = handler.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # checkpoints hold it: it must load with weights_only=True
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    trainer2, evaluator2, _ = _trainer()
    fresh, _ = FACTORIES[name](trainer2, evaluator2, tmp_path / "second")
    fresh.load_state_dict(loaded)
    assert _same(fresh.state_dict(), saved) or name == "Checkpoint"  # a checkpoint's state is its folder


def _same(a: Any, b: Any) -> bool:
    """Equal states, tensors compared by value (an EMA's state holds its weights)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _all_handlers_on_two_ranks(folder: str) -> tuple[int, int, list[str]]:
    trainer, evaluator, data = _trainer()
    attached = []
    for name, factory in sorted(FACTORIES.items()):
        handler, attach = factory(trainer, evaluator, Path(folder) / name)
        attach(handler)
        attached.append(name)
    state = trainer.run(data, max_epochs=2)
    return state.iteration, state.epoch, attached


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [1, 2])
def test_every_handler_runs_at_world_size_1_and_2(nproc: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        results = run_distributed(_all_handlers_on_two_ranks, folder, nproc=nproc, timeout=150)
    assert len(results) == nproc
    assert all(r == (10, 2, sorted(FACTORIES)) for r in results)


def _attached_on_rank_zero_only(name: str, folder: str) -> None:
    """The handler author's classic mistake: every rank builds the handler, rank 0 alone attaches it."""
    from unison.distributed import get_rank

    trainer, evaluator, data = _trainer()
    handler, attach = FACTORIES[name](trainer, evaluator, Path(folder))
    if get_rank() == 0:
        attach(handler)
    trainer.run(data, max_epochs=2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(COLLECTIVE_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_handler_attached_on_one_rank_only_is_named_within_seconds(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With debug on, or at the start of any trainer run for sync contributors, never a hang
    until the collective timeout (240 s here: a report after half of it, setup included, is a hang
    that ended; a loaded machine spends tens of seconds starting ranks and MLflow's store)."""
    import time

    from unison.distributed import RankFailedError

    monkeypatch.setenv("UNISON_DEBUG", "1")
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(
            _attached_on_rank_zero_only, name, str(tmp_path), nproc=2, timeout=COLLECTIVE_TIMEOUT_S
        )
    elapsed = time.monotonic() - started
    assert elapsed < COLLECTIVE_TIMEOUT_S / 2, (
        f"{name}: reported only after {elapsed:.0f} s, a collective timeout"
    )
    assert name in str(info.value), str(info.value)[-2000:]
