"""Run shapes: the hypothesis strategy the differential tests draw from, and how to draw a batch.

A :class:`Shape` is one training run, small enough to take milliseconds: world size, data,
batching, accumulation, epochs, sync cadence, checkpoint cadence, retention and,
optionally, one stop event on one rank. Shapes are drawn in the parent test process
(derandomized, bounded by the active hypothesis profile) and handed as a list to spawned
ranks, which run them all: spawning costs seconds, a run milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

EVENTS = ("terminate", "terminate_epoch", "request_stop")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One run. ``batch_size`` is per rank; ``event`` is ``(kind, rank, iteration)`` or None."""

    world_size: int = 1
    n_samples: int = 8
    batch_size: int = 2
    accumulation: int = 1
    drop_last: bool = False
    shuffle: bool = True
    epoch_length: int | None = None
    max_epochs: int = 1
    sync_every: int | None = None
    ckpt_every: int = 1
    event: tuple[str, int, int] | None = None
    model: str = "linear"  # or "mlp"
    optimizer: str = "sgd"  # or "adam"
    seed: int = 0
    resume_pick: int = 0  # which saved checkpoint a resume test resumes from (modulo their number)
    keep_last: int | None = 2
    keep_best: int = 0
    eval_size: int = 5
    eval_batch: int = 2

    # -- derived ------------------------------------------------------------------------

    @property
    def shard(self) -> int:
        """Samples per rank per epoch (TrainSampler pads, or drops the tail with drop_last)."""
        n, w = self.n_samples, self.world_size
        return n // w if self.drop_last else math.ceil(n / w)

    @property
    def loader_length(self) -> int:
        """Batches per rank per pass over the loader."""
        s, b = self.shard, self.batch_size
        return s // b if self.drop_last else math.ceil(s / b)

    @property
    def iterations_per_epoch(self) -> int:
        return self.epoch_length if self.epoch_length is not None else self.loader_length

    @property
    def total_iterations(self) -> int:
        return self.iterations_per_epoch * self.max_epochs

    def valid(self) -> bool:
        if not 1 <= self.world_size <= 3 or self.n_samples < 1 or self.batch_size < 1:
            return False
        if self.shard < 1 or self.loader_length < 1:
            return False
        if self.epoch_length is not None and self.epoch_length < 1:
            return False
        if self.event is not None:
            kind, rank, iteration = self.event
            if kind not in EVENTS or not 0 <= rank < self.world_size:
                return False
            if not 1 <= iteration <= self.total_iterations:
                return False
        return True

    def short(self) -> str:
        """The fields that differ from the defaults: what a failure message prints."""
        default = Shape()
        diff = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name) or f.name == "world_size"
        }
        return "Shape(" + ", ".join(f"{k}={v!r}" for k, v in diff.items()) + ")"


@st.composite
def shapes(
    draw: Callable[[st.SearchStrategy[Any]], Any],
    *,
    world_sizes: Sequence[int] = (1, 2, 3),
    events: bool = True,
    event_kinds: Sequence[str] = EVENTS,
    epoch_lengths: bool = True,
    events_on_rank_zero_only: bool = False,
    max_samples: int = 23,
) -> Shape:
    """A run shape; dataset sizes include ones that divide by neither world size nor batch."""
    world_size = draw(st.sampled_from(list(world_sizes)))
    drop_last = draw(st.booleans())
    n_samples = draw(st.integers(world_size, max_samples))
    shard = n_samples // world_size if drop_last else math.ceil(n_samples / world_size)
    batch_size = draw(st.integers(1, min(5, shard)))
    loader_length = shard // batch_size if drop_last else math.ceil(shard / batch_size)
    epoch_length = None
    if epoch_lengths:
        # None, or shorter / longer than the loader (the same length is the None case)
        epoch_length = draw(st.one_of(st.none(), st.integers(1, 2 * loader_length + 1)))
    max_epochs = draw(st.integers(1, 3))
    total = (epoch_length or loader_length) * max_epochs
    event = None
    if events and draw(st.booleans()):
        event = (
            draw(st.sampled_from(list(event_kinds))),
            0 if events_on_rank_zero_only else draw(st.integers(0, world_size - 1)),
            draw(st.integers(1, total)),
        )
    shape = Shape(
        world_size=world_size,
        n_samples=n_samples,
        batch_size=batch_size,
        accumulation=draw(st.integers(1, 3)),
        drop_last=drop_last,
        shuffle=draw(st.booleans()),
        epoch_length=epoch_length,
        max_epochs=max_epochs,
        sync_every=draw(st.sampled_from([1, 2, 3, 5, None])),
        ckpt_every=draw(st.integers(1, 5)),
        event=event,
        model=draw(st.sampled_from(["linear", "mlp"])),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        seed=draw(st.integers(0, 3)),
        resume_pick=draw(st.integers(0, 7)),
        keep_last=draw(st.one_of(st.none(), st.integers(1, 3))),
        keep_best=draw(st.integers(0, 2)),
        eval_size=draw(st.integers(1, 11)),
        eval_batch=draw(st.integers(1, 4)),
    )
    assert shape.valid(), shape
    return shape


def draw_shapes(strategy: st.SearchStrategy[Shape], n: int | None = None) -> list[Shape]:
    """Up to ``n`` distinct shapes drawn by hypothesis, derandomized (the same list every run).

    ``n`` defaults to the active profile's ``max_examples`` (``ci`` or ``thorough``, see
    conftest.py). The draw is hypothesis' generate phase only: its first examples are the
    simplest, the later ones spread over the space.
    """
    base = settings()
    limit = base.max_examples if n is None else n
    found: list[Shape] = []

    @settings(
        base,
        max_examples=limit,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(shape: Shape) -> None:
        if shape not in found:
            found.append(shape)

    collect()
    return found[:limit]


def by_world_size(items: Iterable[Shape]) -> dict[int, list[Shape]]:
    groups: dict[int, list[Shape]] = {}
    for shape in items:
        groups.setdefault(shape.world_size, []).append(shape)
    return groups


# -- shrinking (for pinning a failure as an explicit case) -----------------------------------


def simpler(shape: Shape) -> list[Shape]:
    """Valid shapes one step simpler than ``shape``, simplest change first."""
    s = shape
    changes: list[dict[str, Any]] = [
        {"event": None},
        {"max_epochs": 1},
        {"max_epochs": s.max_epochs - 1},
        {"epoch_length": None},
        {"accumulation": 1},
        {"sync_every": None},
        {"sync_every": 1},
        {"model": "linear"},
        {"optimizer": "sgd"},
        {"shuffle": False},
        {"drop_last": False},
        {"batch_size": 1},
        {"n_samples": s.world_size},
        {"n_samples": s.n_samples // 2},
        {"n_samples": s.n_samples - 1},
        {"batch_size": s.batch_size - 1},
        {"ckpt_every": 1},
        {"seed": 0},
        {"keep_last": None},
        {"keep_best": 0},
        {"resume_pick": 0},
    ]
    if s.epoch_length is not None:
        changes.append({"epoch_length": s.epoch_length - 1})
    if s.event is not None:
        kind, rank, iteration = s.event
        changes += [{"event": (kind, 0, iteration)}, {"event": (kind, rank, iteration - 1)}]
    out = []
    for change in changes:
        candidate = dataclasses.replace(s, **change)
        if candidate != s and candidate.valid() and candidate not in out:
            out.append(candidate)
    return out


def shrink(shape: Shape, failing: Callable[[list[Shape]], list[bool]], rounds: int = 30) -> Shape:
    """Greedily simplifies a failing shape; ``failing`` runs a batch of candidates at once."""
    for _ in range(rounds):
        candidates = simpler(shape)
        if not candidates:
            return shape
        verdicts = failing(candidates)
        for candidate, bad in zip(candidates, verdicts, strict=True):
            if bad:
                shape = candidate
                break
        else:
            return shape
    return shape
