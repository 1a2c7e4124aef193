"""Invariant d: evaluation is identical at 1, 2 and 3 ranks.

A fixed float64 classifier is evaluated with ``create_evaluator`` on an ``EvalSampler``
loader (``prepare_loaders``), with Accuracy, Loss (cross-entropy) and MeanSquaredError
(softmax against one-hot). Dataset sizes from 1 to 11, so some do not divide by the world
size and some are smaller than it (a rank gets no sample). Accuracy counts must agree
exactly; the float sums may differ only by the order of summation (relative 1e-12). World
size 1 is also checked against the metrics computed by hand over the whole dataset.
"""

from __future__ import annotations

import pytest
from _shapes import draw_shapes, shapes
from _workers import evaluation_runs, evaluation_truth, failure_report, run_at
from hypothesis import settings

RELATIVE = 1e-12
TIMEOUT = 90 + 4 * settings().max_examples


def _cases(world_size: int):
    # more evaluation shapes than training ones: each is one forward pass
    return draw_shapes(shapes(world_sizes=(world_size,), events=False), 3 * settings().max_examples)


def _disagreement(got: dict[str, float], truth: dict[str, float]) -> str | None:
    if set(got) != set(truth):
        return f"metrics {sorted(got)} != {sorted(truth)}"
    if got["accuracy"] != truth["accuracy"]:
        return f"accuracy {got['accuracy']!r} != {truth['accuracy']!r}"
    for key in ("loss", "mse"):
        if abs(got[key] - truth[key]) > RELATIVE * max(1.0, abs(truth[key])):
            return f"{key} {got[key]!r} != {truth[key]!r}"
    return None


@pytest.mark.distributed
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_evaluation_is_identical_at_any_world_size(world_size):
    cases = _cases(world_size)
    assert any(shape.eval_size < world_size for shape in cases) or world_size == 1
    per_rank = run_at(world_size, evaluation_runs, cases, per_example_s=0.5)
    failures = []
    for i, shape in enumerate(cases):
        # world size 1 in this process is the truth; it must match the hand computation too
        one = evaluation_runs([shape])[0] if world_size > 1 else evaluation_truth(shape)
        for rank, results in enumerate(per_rank):
            problem = _disagreement(results[i], one)
            if problem:
                failures.append((shape, f"rank {rank}: {problem}"))
                break
    assert not failures, failure_report(f"evaluation at {world_size} ranks", failures, len(cases))
