"""Retention: which checkpoints a folder keeps, as a pure function of the manifest's entries."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math

import pytest

from unison.checkpoint import Entry, Retention, best_entry, retain
from unison.checkpoint.manifest import checkpoint_name, entry_for
from unison.checkpoint.retention import check_options, oldest_first, ranked

NAN = float("nan")
INF = float("inf")


def entries(*scores: float | None) -> list[Entry]:
    """One entry per epoch (one iteration each), oldest first, with these scores."""
    return [
        Entry(file=checkpoint_name("ckpt", i, i), epoch=i, iteration=i, score=s)
        for i, s in enumerate(scores, 1)
    ]


def names(*epochs: int) -> tuple[str, ...]:
    return tuple(checkpoint_name("ckpt", e, e) for e in epochs)


# --- a table of cases ----------------------------------------------------------------------------

CASES = [
    # id, scores (oldest first), keep_last, keep_best, mode, kept epochs, best epoch
    ("empty", [], 2, 1, "max", [], None),
    ("one-entry", [0.3], 1, 0, "max", [1], 1),
    ("keep-last-1", [0.1, 0.2, 0.3], 1, 0, "max", [3], 3),
    ("keep-last-2", [0.1, 0.2, 0.3], 2, 0, "max", [2, 3], 3),
    ("keep-last-above-count", [0.1, 0.2], 5, 0, "max", [1, 2], 2),
    ("keep-last-none-keeps-all", [0.1, None, NAN, 0.4], None, 0, "max", [1, 2, 3, 4], 4),
    ("keep-last-none-with-best", [0.9, 0.1, 0.2], None, 1, "max", [1, 2, 3], 1),
    ("no-scores-keep-last-only", [None, None, None], 1, 2, "max", [3], None),
    ("best-early-max", [0.9, 0.5, 0.6, 0.4], 2, 1, "max", [1, 3, 4], 1),
    ("best-early-min", [0.1, 0.5, 0.6, 0.4], 2, 1, "min", [1, 3, 4], 1),
    ("best-is-also-newest", [0.1, 0.2, 0.9], 1, 1, "max", [3], 3),
    ("best-two", [0.9, 0.8, 0.1, 0.2, 0.3], 1, 2, "max", [1, 2, 5], 1),
    ("best-two-min", [0.9, 0.8, 0.1, 0.2, 0.3], 1, 2, "min", [3, 4, 5], 3),
    # ties: the older entry ranks first
    ("tie-max-older-wins", [0.5, 0.9, 0.9, 0.1], 1, 1, "max", [2, 4], 2),
    ("tie-min-older-wins", [0.5, 0.1, 0.1, 0.9], 1, 1, "min", [2, 4], 2),
    ("tie-both-kept-with-two", [0.5, 0.9, 0.9, 0.1], 1, 2, "max", [2, 3, 4], 2),
    ("tie-three-way", [0.7, 0.7, 0.7, 0.1], 1, 2, "max", [1, 2, 4], 1),
    # NaN and None are never the best, whatever the mode and however much room there is
    ("nan-never-best-max", [NAN, 0.5, 0.7, 0.6], 1, 1, "max", [3, 4], 3),
    ("nan-never-best-min", [NAN, 0.5, 0.2, 0.6], 1, 1, "min", [3, 4], 3),
    ("none-never-best", [None, 0.5, 0.2, 0.6], 1, 1, "min", [3, 4], 3),
    ("nan-and-none-skipped-with-room", [NAN, None, 0.2, 0.1], 1, 3, "max", [3, 4], 3),
    ("only-nan", [NAN, NAN, NAN], 1, 2, "max", [3], None),
    # the newest stays, however bad (or unscored) it is
    ("newest-worst-kept", [0.9, 0.8, 0.01], 1, 1, "max", [1, 3], 1),
    ("newest-nan-kept", [0.9, 0.8, NAN], 1, 1, "max", [1, 3], 1),
    ("newest-none-kept", [0.9, 0.8, None], 1, 1, "min", [2, 3], 2),
    # infinities are scores (the handler records non-finite ones as None before they get here)
    ("inf-is-a-score", [0.1, INF, 0.2], 1, 1, "max", [2, 3], 2),
    ("minus-inf-min", [0.1, -INF, 0.2], 1, 1, "min", [2, 3], 2),
    ("negative-scores", [-3.0, -1.0, -2.0, -5.0], 1, 1, "max", [2, 4], 2),
    # with keep_best=0, ``best`` is the best of what stays
    ("best-of-kept-only", [0.9, 0.1, 0.2], 2, 0, "max", [2, 3], 3),
]


@pytest.mark.parametrize(
    "scores, keep_last, keep_best, mode, kept, best", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_retention_table(scores, keep_last, keep_best, mode, kept, best):
    given = entries(*scores)
    plan = retain(given, keep_last=keep_last, keep_best=keep_best, mode=mode)
    assert plan.keep == names(*kept)
    assert plan.delete == tuple(e.file for e in given if e.file not in plan.keep)
    assert (plan.best.file if plan.best else None) == (names(best)[0] if best else None)


# --- invariants over every small case ------------------------------------------------------------

ALPHABET = [0.1, 0.5, 0.9, None, NAN]
"""Scores drawn from few values, so that ties, None and NaN are frequent."""


def _beats(a: Entry, b: Entry, a_index: int, b_index: int, mode: str) -> bool:
    """Whether ``a`` ranks before ``b``: a better score, or the same score and older."""
    if a.score == b.score:
        return a_index < b_index
    return a.score > b.score if mode == "max" else a.score < b.score


def _reference_best(given: list[Entry], k: int, mode: str) -> set[str]:
    """The best ``k`` by counting, for each scored entry, the scored entries that beat it."""
    scored = [(i, e) for i, e in enumerate(given) if e.score is not None and not math.isnan(e.score)]
    return {e.file for i, e in scored if sum(_beats(o, e, j, i, mode) for j, o in scored if j != i) < k}


def _all_cases():
    for n in range(0, 5):
        for scores in itertools.product(ALPHABET, repeat=n):
            for keep_last, keep_best, mode in itertools.product([None, 1, 2, 3], [0, 1, 2], ["max", "min"]):
                yield list(scores), keep_last, keep_best, mode


def test_retention_invariants_hold_in_every_small_case():
    checked = 0
    for scores, keep_last, keep_best, mode in _all_cases():
        given = entries(*scores)
        frozen = copy.deepcopy(given)
        plan = retain(given, keep_last=keep_last, keep_best=keep_best, mode=mode)
        where = f"scores={scores} keep_last={keep_last} keep_best={keep_best} mode={mode}"
        files = [e.file for e in given]
        # keep and delete partition the entries, each in the entries' order
        assert sorted(plan.keep + plan.delete) == sorted(files), where
        assert list(plan.keep) == [f for f in files if f in plan.keep], where
        assert list(plan.delete) == [f for f in files if f in plan.delete], where
        # the newest keep_last stay (all, with None); the newest is never deleted
        newest = files if keep_last is None else files[-keep_last:]
        assert set(newest) <= set(plan.keep), where
        assert not files or files[-1] in plan.keep, where
        # the best keep_best stay, and nothing else
        best_k = _reference_best(given, keep_best, mode)
        assert best_k <= set(plan.keep), where
        assert set(plan.keep) == set(newest) | best_k, where
        # best: the best-ranked kept entry, never an unscored one
        kept = [e for e in given if e.file in plan.keep]
        expected_best = _reference_best(kept, 1, mode)
        assert ({plan.best.file} if plan.best else set()) == expected_best, where
        if plan.best is not None:
            assert plan.best.score is not None and not math.isnan(plan.best.score), where
        # pure: the input is untouched, and the answer the same twice
        assert given == frozen, where
        assert retain(given, keep_last=keep_last, keep_best=keep_best, mode=mode) == plan, where
        checked += 1
    assert checked > 5000, "the exhaustive table shrank"


def test_the_order_of_the_entries_alone_says_which_is_newest():
    """Without save sequences (and with equal times) the order given decides, newest last."""
    given = entries(0.1, 0.2, 0.3)
    shuffled = [given[2], given[0], given[1]]
    assert oldest_first(shuffled) == shuffled
    plan = retain(shuffled, keep_last=1)
    assert plan.keep == (given[1].file,) and plan.delete == (given[2].file, given[0].file)
    # ties go to the entry that comes first
    tied = entries(0.5, 0.5)
    assert best_entry(tied, "max") is tied[0] and best_entry(list(reversed(tied)), "max") is tied[1]
    assert ranked(list(reversed(tied)), "min") == [tied[1], tied[0]]


def test_the_save_sequence_decides_which_is_newest_never_the_iteration():
    legacy_old = Entry("a.pt", 8, 800, saved_at=1000.0)
    legacy_new = Entry("b.pt", 9, 900, saved_at=2000.0)
    resumed = [Entry("c.pt", 3, 3, saved_at=10.0, sequence=3), Entry("d.pt", 4, 4, saved_at=5.0, sequence=4)]
    # files from before sequences were recorded come first, by time of saving
    assert oldest_first([resumed[1], legacy_new, resumed[0], legacy_old]) == [
        legacy_old,
        legacy_new,
        *resumed,
    ]
    plan = retain([legacy_old, legacy_new, *resumed], keep_last=2)
    assert plan.keep == ("c.pt", "d.pt") and plan.delete == ("a.pt", "b.pt")


def test_best_entry_ignores_unscored_entries():
    assert best_entry([], "max") is None
    assert best_entry(entries(None, NAN), "min") is None
    assert best_entry(entries(NAN, 0.3, None, 0.2), "max").epoch == 2
    assert best_entry(entries(NAN, 0.3, None, 0.2), "min").epoch == 4


def test_a_retention_is_plain_data():
    plan = retain(entries(0.9, 0.1), keep_last=1, keep_best=1)
    assert plan == Retention(keep=names(1, 2), delete=(), best=entries(0.9)[0])
    with pytest.raises(AttributeError):
        plan.keep = ()  # frozen


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(keep_last=0), r"retain\(keep_last=0\) must be a positive int or None"),
        (dict(keep_last=-1), r"keep_last=-1"),
        (dict(keep_last=True), r"keep_last=True"),
        (dict(keep_last=1.5), r"keep_last=1.5"),
        (dict(keep_last=1, keep_best=-1), r"retain\(keep_best=-1\) must be an int >= 0"),
        (dict(keep_last=1, keep_best=False), r"keep_best=False"),
        (dict(keep_last=1, mode="best"), r"retain\(mode='best'\) must be 'max' or 'min'"),
    ],
)
def test_retain_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        retain(entries(0.1), **options)


def test_option_messages_name_the_caller():
    with pytest.raises(ValueError, match=r"Checkpoint\(keep_last=0\)"):
        check_options(keep_last=0, keep_best=0, mode="max", who="Checkpoint")


# --- the manifest entry of a new checkpoint -------------------------------------------------------


@pytest.mark.parametrize(
    "score, recorded", [(0.5, 0.5), (None, None), (NAN, None), (INF, None), (-INF, None)]
)
def test_a_new_entry_records_only_finite_scores(score, recorded):
    entry = entry_for({"epoch": 2, "iteration": 7, "score": score}, "run")
    assert entry == Entry(file=checkpoint_name("run", 2, 7), epoch=2, iteration=7, score=recorded)


# --- entry equality: what a checkpoint is, never float equality ----------------------------------


def _nan_entry(**changes) -> Entry:
    fields = {"file": "a.pt", "epoch": 1, "iteration": 5, "score": float("nan"), "saved_at": 2.5, "size": 9}
    return Entry(**{**fields, **changes})


def test_entries_with_a_nan_score_equal_each_other_whatever_the_python():
    """Two records of one checkpoint are equal though NaN != NaN: each ``float("nan")`` is a
    new object, as after a JSON round trip, so neither identity (what dataclass equality
    relied on up to Python 3.12) nor ``==`` (field by field, from 3.13) can make them so."""
    a, b = _nan_entry(), _nan_entry()
    assert a.score is not b.score
    assert a == b and not a != b
    again = Entry(**json.loads(json.dumps(dataclasses.asdict(a))))
    assert again == a and [again] == [a] and again in [a]
    assert copy.deepcopy([a]) == [a]


@pytest.mark.parametrize(
    "change",
    [
        {"score": 0.5},
        {"score": None},
        {"file": "b.pt"},
        {"epoch": 2},
        {"iteration": 6},
        {"saved_at": 3.0},
        {"size": 10},
        {"sequence": 4},
    ],
)
def test_entries_that_differ_in_any_field_are_not_equal(change):
    assert _nan_entry() != _nan_entry(**change) and _nan_entry(**change) != _nan_entry()
    assert _nan_entry(score=0.25) == _nan_entry(score=0.25) and _nan_entry(score=None) == _nan_entry(
        score=None
    )
    assert _nan_entry() != "a.pt"
