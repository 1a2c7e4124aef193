"""Invariant c: every rank records the same decisions.

For each drawn shape (with an evaluation at every epoch end, checkpoints every
``ckpt_every`` iterations, and possibly one stop event on one rank), every rank must
report the same stop iteration and epoch, the same iterations at which ``Checkpoint.save``
was called, the same evaluation metrics and the same epoch losses. A stop requested with
``terminate()``/``request_stop()`` at iteration ``i`` takes effect at or after ``i`` and no
later than the end of that epoch (the epoch's sync point always settles it).
"""

from __future__ import annotations

import math

import pytest
from _shapes import draw_shapes, shapes
from _workers import decision_runs, failure_report, run_at
from hypothesis import settings

TIMEOUT = 90 + 8 * settings().max_examples


def _disagreement(shape, ranks: list[dict]) -> str | None:
    first = ranks[0]
    for key in ("stop", "saves", "metrics", "losses"):
        for r, result in enumerate(ranks[1:], start=1):
            if result[key] != first[key]:
                return f"{key}: rank {r} recorded {result[key]}, rank 0 {first[key]}"
    stop, _ = first["stop"]
    if shape.event is not None and shape.event[0] in ("terminate", "request_stop"):
        asked = shape.event[2]
        per_epoch = shape.iterations_per_epoch
        epoch_end = math.ceil(asked / per_epoch) * per_epoch
        if not asked <= stop <= epoch_end:
            return f"asked to stop at iteration {asked}; all stopped after {stop}, not within [{asked}, {epoch_end}]"
    if first["saves"] and first["saves"][-1] != stop:
        return f"the last save was at iteration {first['saves'][-1]}, the run ended at {stop} (at_end=True)"
    return None


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_records_the_same_decisions(world_size, tmp_path):
    cases = draw_shapes(shapes(world_sizes=(world_size,)))
    per_rank = run_at(world_size, decision_runs, cases, str(tmp_path), per_example_s=1.5)
    failures = []
    for i, shape in enumerate(cases):
        problem = _disagreement(shape, [rank[i] for rank in per_rank])
        if problem:
            failures.append((shape, problem))
    assert not failures, failure_report(f"decisions at {world_size} ranks", failures, len(cases))
