"""Which checkpoints a folder keeps: the newest few and the best few. Pure functions, no I/O.

Rotation is a decision apart from its wiring: given the manifest's entries it says which
files stay and which go, and the handler deletes them only once the manifest recording
that is durable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from unison.checkpoint.entry import Entry


@dataclass(frozen=True)
class Retention:
    """The outcome of :func:`retain`.

    Attributes:
        keep: the files that stay, in the order of the entries given.
        delete: the files that go, in the order of the entries given.
        best: the best entry that stays, by score; None when no entry kept has a score.
    """

    keep: tuple[str, ...]
    delete: tuple[str, ...]
    best: Entry | None


def age(entry: Entry) -> tuple[int, float]:
    """The sort key of :func:`oldest_first`: the save sequence, never the iteration.

    Iterations restart their count whenever a resume changes the world size or the batch
    size, so a newer checkpoint can hold a smaller iteration; the save sequence only grows.
    Entries without one (files from before unison recorded it) come first, by their time of
    saving.
    """
    if entry.sequence is None:
        return (0, entry.saved_at)
    return (1, float(entry.sequence))


def oldest_first(entries: Sequence[Entry]) -> list[Entry]:
    """The entries from the oldest to the newest: the one place that defines "newest".

    Ordered by :func:`age` (the save sequence; entries that have none first, by time of
    saving); equal ages keep the order given. The manifest keeps its entries in this order,
    and everything else (the newest ``keep_last``, which of two equal scores wins, where
    ``resume("auto")`` starts) follows from it.

    Example:
        >>> old, new = Entry("a.pt", 9, 900, sequence=1), Entry("b.pt", 10, 40, sequence=2)
        >>> [e.file for e in oldest_first([new, old])]
        ['a.pt', 'b.pt']
    """
    return sorted(entries, key=age)


def has_score(entry: Entry) -> bool:
    """Whether ``entry`` can be ranked: a score that is neither None nor NaN."""
    return entry.score is not None and not math.isnan(entry.score)


def ranked(entries: Sequence[Entry], mode: Literal["max", "min"]) -> list[Entry]:
    """The entries that have a score, best first; of equal scores, the older one first.

    Args:
        entries: manifest entries, oldest first (see :func:`oldest_first`).
        mode: ``"max"`` when higher scores are better, ``"min"`` when lower ones are.
    """
    _check_mode(mode, "ranked")
    sign = -1.0 if mode == "max" else 1.0
    aged = list(enumerate(e for e in oldest_first(entries) if has_score(e)))
    aged.sort(key=lambda pair: (sign * _score(pair[1]), pair[0]))
    return [entry for _, entry in aged]


def best_entry(entries: Sequence[Entry], mode: Literal["max", "min"]) -> Entry | None:
    """The best entry by score, the older of equal ones (see :func:`ranked`); None when none has a score.

    Example:
        >>> entries = [Entry("a.pt", 1, 1, 0.5), Entry("b.pt", 2, 2, float("nan")), Entry("c.pt", 3, 3, 0.7)]
        >>> best_entry(entries, "max").file, best_entry(entries, "min").file
        ('c.pt', 'a.pt')
    """
    ordered = ranked(entries, mode)
    return ordered[0] if ordered else None


def retain(
    entries: Sequence[Entry],
    *,
    keep_last: int | None,
    keep_best: int = 0,
    mode: Literal["max", "min"] = "max",
) -> Retention:
    """Which checkpoints to keep: the newest ``keep_last`` and the best ``keep_best``.

    The newest entry is always kept (``keep_last`` is at least 1); an entry whose score is
    None or NaN is never among the best; of equal scores the older entry ranks first.

    Args:
        entries: the manifest's entries, oldest first (see :func:`oldest_first`).
        keep_last: how many of the newest to keep, >= 1; None keeps every entry.
        keep_best: how many of the best by score to keep as well, >= 0.
        mode: ``"max"`` when higher scores are better, ``"min"`` when lower ones are.

    Returns:
        The files to keep and to delete, and the best entry kept.

    Raises:
        ValueError: for a ``keep_last`` below 1, a negative ``keep_best`` or another mode.

    Example:
        >>> entries = [Entry(f"e{i}.pt", i, i, score) for i, score in enumerate([0.9, 0.1, 0.2, 0.3])]
        >>> plan = retain(entries, keep_last=2, keep_best=1)
        >>> plan.keep, plan.delete, plan.best.file
        (('e0.pt', 'e2.pt', 'e3.pt'), ('e1.pt',), 'e0.pt')
    """
    check_options(keep_last=keep_last, keep_best=keep_best, mode=mode)
    ordered = oldest_first(entries)
    kept = {e.file for e in (ordered if keep_last is None else ordered[-keep_last:])}
    kept.update(e.file for e in ranked(ordered, mode)[:keep_best])
    keep = tuple(e.file for e in ordered if e.file in kept)
    delete = tuple(e.file for e in ordered if e.file not in kept)
    return Retention(keep=keep, delete=delete, best=best_entry([e for e in ordered if e.file in kept], mode))


def _score(entry: Entry) -> float:
    assert entry.score is not None  # ranked() only ever sees entries with has_score()
    return entry.score


def check_options(*, keep_last: int | None, keep_best: int, mode: str, who: str = "retain") -> None:
    """Checks the options of :func:`retain`; ``who`` names the caller in the messages.

    Raises:
        ValueError: for a ``keep_last`` below 1, a negative ``keep_best`` or another mode.
    """
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"{who}(keep_last={keep_last!r}) must be a positive int or None.")
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
        raise ValueError(f"{who}(keep_best={keep_best!r}) must be an int >= 0.")
    _check_mode(mode, who)


def _check_mode(mode: str, who: str = "retain") -> None:
    if mode not in ("max", "min"):
        raise ValueError(f"{who}(mode={mode!r}) must be 'max' or 'min'.")
