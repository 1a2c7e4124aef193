"""unison/handlers/pruning.py: AgreedPruning asks its judge on rank 0 only, and every rank stops
after the same iteration when it says to prune (2 gloo ranks, one spawn for all scenarios)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from unison.distributed import get_rank
from unison.engine import Engine, Events
from unison.handlers.pruning import AgreedPruning
from unison.testing import run_distributed


class _Judge:
    """Prunes after epoch ``at``; refuses to be asked anywhere but on rank 0."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.asked: list[tuple[float, int]] = []

    def __call__(self, value: float, step: int) -> str | None:
        if get_rank() != 0:
            raise AssertionError(f"rank {get_rank()} asked the judge")
        self.asked.append((value, step))
        return "lagging" if step == self.at else None


def _one_run(at: int | None, sync_every: int | None) -> dict[str, Any]:
    trainer = Engine(lambda e, b: torch.tensor(1.0), sync_every=sync_every)
    evaluator = Engine(lambda e, b: None)

    @evaluator.on(Events.COMPLETED)
    def score(engine: Engine) -> None:  # a different value on each rank: only rank 0's is read
        engine.state.metrics["loss"] = float(trainer.state.epoch + 10 * get_rank())

    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([0]))
    judge = _Judge(at)
    pruning = AgreedPruning(trainer, "loss", judge)
    pruning.attach(evaluator)
    pruning.attach(evaluator)  # twice: no second vote
    state = trainer.run(range(5), max_epochs=4)
    return {"iteration": state.iteration, "pruned": pruning.pruned, "asked": judge.asked}


def pruning_worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_one_run(s["at"], s["sync_every"]) for s in scenarios]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rank_zero_asks_once_per_evaluation_and_every_rank_stops_after_the_same_iteration() -> None:
    scenarios = [{"at": 2, "sync_every": None}, {"at": 3, "sync_every": 2}, {"at": None, "sync_every": 2}]
    rank0, rank1 = run_distributed(pruning_worker, scenarios, nproc=2, timeout=90)
    assert [r["iteration"] for r in rank0] == [r["iteration"] for r in rank1] == [10, 15, 20]
    assert [r["pruned"] for r in rank0] == [r["pruned"] for r in rank1] == [True, True, False]
    assert rank0[0]["asked"] == [(1.0, 1), (2.0, 2)] and rank0[2]["asked"] == [
        (float(e), e) for e in range(1, 5)
    ]
    assert all(r["asked"] == [] for r in rank1)


def test_a_missing_metric_is_named() -> None:
    trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
    AgreedPruning(trainer, "accuracy", lambda value, step: None).attach(evaluator)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([0]))
    with pytest.raises(KeyError, match="metric='accuracy'"):
        trainer.run(range(2), max_epochs=1)


def test_it_needs_a_unison_trainer() -> None:
    from ignite.engine import Engine as IgniteEngine

    with pytest.raises(TypeError, match="AgreedPruning"):
        AgreedPruning(IgniteEngine(lambda e, b: None), "loss", lambda value, step: None)
