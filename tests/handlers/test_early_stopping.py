"""EarlyStopping: a rank-local score still stops every rank at the same epoch."""

from __future__ import annotations

import io

import pytest
import torch
from _control_workers import early_stopping_worker, ones
from ignite.engine import Engine as IgniteEngine

from unison.engine import Engine, Events
from unison.handlers import EarlyStopping
from unison.testing import run_distributed

PATIENCE = 2
MAX_EPOCHS = 10
TRAIN_LENGTH = 5  # the worker's trainer runs over range(5)
# Higher is better. Each rank's own verdict comes at a different epoch (5, 3 and 8 with
# patience 2), so the three agreements give three different answers at 3 ranks.
SEQUENCES = [
    [1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 6.0, 6.0, 6.0, 6.0],
]


def first_stop(scores: list[float], patience: int) -> int | None:
    """The epoch (1-based) at which ``patience`` scores in a row have not beaten the best (mode max)."""
    best, count = None, 0
    for epoch, score in enumerate(scores, start=1):
        if best is None or score > best:
            best, count = score, 0
            continue
        count += 1
        if count >= patience:
            return epoch
    return None


def expected_epoch(world_size: int, agreement: str) -> int:
    own = [first_stop(SEQUENCES[r], PATIENCE) or MAX_EPOCHS for r in range(world_size)]
    return {"rank_zero": own[0], "any": min(own), "all": max(own)}[agreement]


@pytest.fixture(scope="module")
def stopping_runs():
    cache: dict = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_distributed(
                early_stopping_worker,
                SEQUENCES[:world_size],
                PATIENCE,
                MAX_EPOCHS,
                nproc=world_size,
                timeout=60,
            )
        return cache[world_size]

    return get


def test_the_sequences_tell_the_agreements_apart():
    assert [first_stop(s, PATIENCE) for s in SEQUENCES] == [5, 3, 8]
    assert len({expected_epoch(3, a) for a in ("rank_zero", "any", "all")}) == 3


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("attached_to", ["trainer", "evaluator"])
@pytest.mark.parametrize("agreement", ["rank_zero", "any", "all"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_local_score_stops_every_rank_at_the_agreed_epoch(
    stopping_runs, world_size, agreement, attached_to
):
    results = [r[(agreement, attached_to)] for r in stopping_runs(world_size)]
    epoch = expected_epoch(world_size, agreement)
    assert [(r["epoch"], r["iteration"]) for r in results] == [(epoch, epoch * TRAIN_LENGTH)] * world_size
    if attached_to == "evaluator":
        # One evaluation per epoch, up to the stop, on every rank.
        assert [r["evaluations"] for r in results] == [list(range(1, epoch + 1))] * world_size
    # Rank 0 says why, and which ranks had voted to stop by then.
    voters = [r for r in range(world_size) if (first_stop(SEQUENCES[r], PATIENCE) or MAX_EPOCHS + 1) <= epoch]
    logged = [m for m in results[0]["logs"] if "early stopping" in m]
    assert len(logged) == 1, results[0]["logs"]
    assert f"ranks voting to stop: {voters}" in logged[0] and f"agreement {agreement!r}" in logged[0]


# --- world size 1 ----------------------------------------------------------------------------------


def _trainer_with_stopper(scores: list[float], patience: int, state: dict | None = None):
    trainer = Engine(ones, sync_every=3, name="trainer")
    stopper = EarlyStopping(trainer, lambda e: scores[e.state.epoch - 1], patience=patience, mode="max")
    stopper.attach(trainer)
    if state is not None:
        trainer.load_state_dict(state["trainer"])
        stopper.load_state_dict(state["stopper"])
    return trainer, stopper


def test_state_dict_round_trip_resumes_the_count():
    scores = [1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    patience = 3
    stop = first_stop(scores, patience)
    assert stop == 6

    trainer, _ = _trainer_with_stopper(scores, patience)
    assert trainer.run(range(TRAIN_LENGTH), max_epochs=len(scores)).epoch == stop

    # Interrupted after epoch 4, with one evaluation already counted against patience.
    trainer, stopper = _trainer_with_stopper(scores, patience)
    trainer.run(range(TRAIN_LENGTH), max_epochs=4)
    assert stopper.checker.counter == 1
    buffer = io.BytesIO()
    torch.save({"trainer": trainer.state_dict(), "stopper": stopper.state_dict()}, buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    resumed, _ = _trainer_with_stopper(scores, patience, state)
    assert resumed.run(range(TRAIN_LENGTH), max_epochs=len(scores)).epoch == stop
    # Without the stopper's state the count starts over: it would stop later.
    forgetful, _ = _trainer_with_stopper(
        scores,
        patience,
        {"trainer": state["trainer"], "stopper": {"checker": {"best": None, "counter": 0, "stopped": False}}},
    )
    assert forgetful.run(range(TRAIN_LENGTH), max_epochs=len(scores)).epoch > stop


def test_attached_to_an_evaluator_it_counts_evaluations_and_stops_the_trainer():
    scores = [0.5, 0.25, 0.25, 0.25, 0.75, 0.75]
    trainer = Engine(ones, sync_every=3, name="trainer")
    evaluator = Engine(ones, sync_every=None, name="evaluator")
    evaluator.add_event_handler(
        Events.COMPLETED, lambda e: e.state.metrics.__setitem__("accuracy", scores[trainer.state.epoch - 1])
    )
    stopper = EarlyStopping(trainer, "accuracy", patience=3, mode="max")
    stopper.attach(evaluator)
    stopper.attach(evaluator)  # twice: still one handler
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(range(2)))
    state = trainer.run(range(TRAIN_LENGTH), max_epochs=len(scores))
    assert state.epoch == first_stop(scores, 3) == 4
    assert stopper.checker.counter == 3


def test_a_missing_metric_name_says_which_there_are():
    trainer = Engine(ones, name="trainer")
    evaluator = Engine(ones, sync_every=None, name="evaluator")
    evaluator.add_event_handler(Events.COMPLETED, lambda e: e.state.metrics.__setitem__("accuracy", 1.0))
    EarlyStopping(trainer, "acc", patience=1).attach(evaluator)
    with pytest.raises(KeyError) as info:
        evaluator.run(range(2))
    assert "'acc'" in str(info.value) and "['accuracy']" in str(info.value)


def test_bad_arguments_raise_naming_the_argument():
    trainer = Engine(ones)
    with pytest.raises(TypeError, match="unison Engine"):
        EarlyStopping(IgniteEngine(ones), "loss", patience=1)
    with pytest.raises(ValueError, match="agreement='majority'"):
        EarlyStopping(trainer, "loss", patience=1, agreement="majority")
    with pytest.raises(TypeError, match="metric"):
        EarlyStopping(trainer, 3, patience=1)
    with pytest.raises(ValueError, match="patience=0"):
        EarlyStopping(trainer, "loss", patience=0)
