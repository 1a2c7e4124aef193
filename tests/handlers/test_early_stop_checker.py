"""EarlyStopChecker: the pure decision, score by score.

The scores are binary fractions (halves, quarters, eighths), so every comparison with a
margin is exact.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from unison.handlers import EarlyStopChecker


def verdicts(checker: EarlyStopChecker, scores: list[float]) -> list[bool]:
    return [checker.update(s) for s in scores]


# --- patience and direction ----------------------------------------------------------------------


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_patience_scores_without_improvement_then_stop(patience):
    scores = [5.0] + [6.0] * patience  # lower is better: every later score is worse
    assert verdicts(EarlyStopChecker(patience), scores) == [False] * patience + [True]


def test_an_improvement_resets_the_count():
    checker = EarlyStopChecker(patience=2)
    # worse, better (reset), worse, worse -> stop on the last
    assert verdicts(checker, [5.0, 6.0, 4.0, 6.0, 6.0]) == [False, False, False, False, True]
    assert checker.best == 4.0 and checker.counter == 2


def test_an_equal_score_is_not_an_improvement():
    assert verdicts(EarlyStopChecker(patience=1, mode="max"), [0.5, 0.5]) == [False, True]


@pytest.mark.parametrize(
    ("mode", "scores"),
    [("min", [4.0, 3.0, 2.0, 1.0]), ("max", [1.0, 2.0, 3.0, 4.0])],
)
def test_steady_improvement_in_the_mode_direction_never_stops(mode, scores):
    checker = EarlyStopChecker(patience=1, mode=mode)
    assert verdicts(checker, scores) == [False] * 4
    assert checker.best == scores[-1]


@pytest.mark.parametrize(
    ("mode", "scores"),
    [("min", [1.0, 2.0]), ("max", [2.0, 1.0])],
)
def test_the_other_direction_counts_as_no_improvement(mode, scores):
    assert verdicts(EarlyStopChecker(patience=1, mode=mode), scores) == [False, True]


def test_once_stopped_it_stays_stopped():
    checker = EarlyStopChecker(patience=1)
    assert verdicts(checker, [1.0, 2.0, 0.0]) == [False, True, True]
    assert checker.stopped


def test_reset_forgets_every_score():
    checker = EarlyStopChecker(patience=1)
    verdicts(checker, [1.0, 2.0])
    checker.reset()
    assert (checker.best, checker.counter, checker.stopped) == (None, 0, False)
    assert verdicts(checker, [9.0, 8.0]) == [False, False]


# --- thresholds ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "best", "within", "beyond"),
    [("min", 10.0, 9.5, 9.25), ("max", 10.0, 10.5, 10.75)],
)
def test_abs_threshold_needs_a_change_larger_than_min_delta(mode, best, within, beyond):
    # min_delta=0.5: a change of exactly 0.5 is not enough, 0.75 is.
    assert verdicts(EarlyStopChecker(1, mode=mode, min_delta=0.5), [best, within]) == [False, True]
    assert verdicts(EarlyStopChecker(1, mode=mode, min_delta=0.5), [best, beyond]) == [False, False]


@pytest.mark.parametrize(
    ("mode", "best", "within", "beyond"),
    [
        ("min", 8.0, 7.0, 6.5),  # margin 0.125 * |8| = 1
        ("max", 8.0, 9.0, 9.5),
        ("max", -8.0, -7.0, -6.5),  # |best|: the margin stays positive for negative scores
        ("min", -8.0, -9.0, -9.5),
    ],
)
def test_rel_threshold_scales_min_delta_by_the_best_score(mode, best, within, beyond):
    make = lambda: EarlyStopChecker(1, mode=mode, min_delta=0.125, threshold_mode="rel")  # noqa: E731
    assert verdicts(make(), [best, within]) == [False, True]
    assert verdicts(make(), [best, beyond]) == [False, False]


def test_abs_and_rel_differ_for_the_same_min_delta():
    # min_delta=0.25 from 8: abs needs < 7.75, rel needs < 8 - 0.25 * 8 = 6.
    scores = [8.0, 7.5]
    assert verdicts(EarlyStopChecker(1, min_delta=0.25, threshold_mode="abs"), scores) == [False, False]
    assert verdicts(EarlyStopChecker(1, min_delta=0.25, threshold_mode="rel"), scores) == [False, True]


def test_cumulative_delta_lets_small_steps_add_up():
    # Steps of 0.5 against min_delta=1: none is an improvement on its own.
    scores = [10.0, 9.5, 9.0, 8.5]
    plain = EarlyStopChecker(3, min_delta=1.0)
    cumulative = EarlyStopChecker(3, min_delta=1.0, cumulative_delta=True)
    # Without: each score is compared with the previous best, which follows it down.
    assert verdicts(plain, scores) == [False, False, False, True]
    assert plain.best == 8.5
    # With: compared with 10 (the last improvement), 8.5 is 1.5 better: an improvement.
    assert verdicts(cumulative, scores) == [False, False, False, False]
    assert (cumulative.best, cumulative.counter) == (8.5, 0)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("first", [True, False])
def test_a_nan_score_raises(first):
    checker = EarlyStopChecker(2)
    if not first:
        checker.update(1.0)
    with pytest.raises(ValueError, match="NaN"):
        checker.update(math.nan)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"patience": 0}, "patience=0"),
        ({"patience": -1}, "patience=-1"),
        ({"patience": 1.5}, "patience=1.5"),
        ({"patience": True}, "patience=True"),
        ({"patience": "3"}, "patience='3'"),
        ({"patience": 1, "mode": "minimum"}, "mode='minimum'"),
        ({"patience": 1, "min_delta": -0.1}, "min_delta=-0.1"),
        ({"patience": 1, "min_delta": True}, "min_delta=True"),
        ({"patience": 1, "min_delta": "0.1"}, "min_delta='0.1'"),
        ({"patience": 1, "threshold_mode": "relative"}, "threshold_mode='relative'"),
    ],
)
def test_bad_arguments_raise_naming_the_argument_and_value(kwargs, named):
    with pytest.raises(ValueError) as info:
        EarlyStopChecker(**kwargs)
    assert named in str(info.value)


# --- state ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cumulative_delta", [False, True])
def test_state_dict_round_trip_continues_exactly(cumulative_delta):
    scores = [10.0, 9.5, 9.0, 11.0, 8.5, 8.75, 9.0, 9.25]
    kwargs = {"patience": 3, "min_delta": 1.0, "cumulative_delta": cumulative_delta}
    whole = verdicts(EarlyStopChecker(**kwargs), scores)
    assert True in whole  # the sequence does stop: the resumed run has something to agree with

    first = EarlyStopChecker(**kwargs)
    head = verdicts(first, scores[:3])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    resumed = EarlyStopChecker(**kwargs)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert head + verdicts(resumed, scores[3:]) == whole
    # Without the state the rest of the sequence is judged differently.
    assert head + verdicts(EarlyStopChecker(**kwargs), scores[3:]) != whole


def test_state_dict_of_a_fresh_checker_round_trips():
    checker = EarlyStopChecker(2)
    other = EarlyStopChecker(2)
    other.update(1.0)
    other.load_state_dict(checker.state_dict())
    assert (other.best, other.counter, other.stopped) == (None, 0, False)
