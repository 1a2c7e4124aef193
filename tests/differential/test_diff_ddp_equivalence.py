"""Invariant a: N ranks with per-rank batch B train like one process with batch N*B.

The truth is one process, at world size 1, whose loader yields the global batches: batch
``i`` is the union of every rank's batch ``i`` as TrainSampler shards them (padded, or cut
with drop_last). Every rank's batch ``i`` has the same size, so the mean loss over the union
is DDP's mean of per-rank means, and parameters agree to float64 rounding. Stop events are
left out: at world size 1 a stop acts at once, with several ranks at the next sync point.
"""

from __future__ import annotations

import pytest
import torch
from _shapes import draw_shapes, shapes
from _workers import ddp_runs, failure_report, one_process_truth, run_at
from hypothesis import settings

TOLERANCE = 1e-10
TIMEOUT = 90 + 6 * settings().max_examples


def _disagreement(shape, ranks, truth) -> str | None:
    first = ranks[0]
    for r, result in enumerate(ranks[1:], start=1):
        if not torch.equal(result["params"], first["params"]):
            return f"rank {r}'s parameters differ from rank 0's"
    if first["iteration"] != truth["iteration"]:
        return f"iterations: {first['iteration']} at {shape.world_size} ranks, {truth['iteration']} in one process"
    diff = float((first["params"] - truth["params"]).abs().max())
    if diff > TOLERANCE:
        return f"parameters differ from one process with the global batch by {diff:.3g} (> {TOLERANCE})"
    if len(first["losses"]) != len(truth["losses"]) or any(
        abs(a - b) > TOLERANCE * max(1.0, abs(b))
        for a, b in zip(first["losses"], truth["losses"], strict=True)
    ):
        return f"epoch losses {first['losses']} != {truth['losses']} (one process)"
    return None


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [2, 3])
def test_n_ranks_train_like_one_process_with_the_global_batch(world_size):
    cases = draw_shapes(shapes(world_sizes=(world_size,), events=False))
    per_rank = run_at(world_size, ddp_runs, cases, per_example_s=1.0)
    failures = []
    for i, shape in enumerate(cases):
        problem = _disagreement(shape, [rank[i] for rank in per_rank], one_process_truth(shape))
        if problem:
            failures.append((shape, problem))
    assert not failures, failure_report("N ranks vs one process", failures, len(cases))
