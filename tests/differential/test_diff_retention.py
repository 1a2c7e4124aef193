"""Invariant e: retention never deletes the newest or the best checkpoint; the manifest round-trips.

After each drawn run with ``keep_last`` / ``keep_best`` (best by the evaluator's ``mse``,
mode ``min``), on rank 0: the newest file written exists, a file with the best score
written exists, no more than ``keep_last + keep_best`` files are kept, ``manifest.json``
lists exactly the files in the folder, and ``unison.checkpoint.Manifest`` rebuilt from the
folder equals the manifest written (and the handler's own).
"""

from __future__ import annotations

import pytest
from _shapes import EVENTS, draw_shapes, shapes
from _workers import failure_report, retention_runs, run_at
from hypothesis import settings

TIMEOUT = 90 + 8 * settings().max_examples


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [1, 2])
def test_retention_keeps_newest_and_best_and_the_manifest_round_trips(world_size, tmp_path):
    cases = draw_shapes(shapes(world_sizes=(world_size,), event_kinds=EVENTS))
    per_rank = run_at(world_size, retention_runs, cases, str(tmp_path), per_example_s=1.5)
    failures = [
        (shape, "; ".join(problems)) for shape, problems in zip(cases, per_rank[0], strict=True) if problems
    ]
    assert not failures, failure_report(f"retention at {world_size} ranks", failures, len(cases))
