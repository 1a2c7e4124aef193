"""Evaluation is exact: metrics at 1, 2 and 3 ranks equal a single-process computation.

Each distributed test runs a module-level function of ``_metric_workers`` on every rank with
``run_distributed``; the rank returns plain numbers and the assertions happen here, against
values computed directly with torch over the whole dataset.
"""

from __future__ import annotations

import math

import pytest
from _metric_workers import (
    SIZES,
    count_evaluation_collectives,
    evaluate_every_size,
    padded_sampler_accuracy,
    reference,
)
from torch.utils.data import DistributedSampler

from unison.testing import run_distributed

# --- tests -----------------------------------------------------------------------------------------------


def _assert_metrics_equal(got: dict[str, float], want: dict[str, float], exact: set[str], where: str) -> None:
    assert set(got) == set(want), where
    for name, value in want.items():
        if name in exact:
            assert got[name] == value, f"{where}: {name} = {got[name]!r}, expected exactly {value!r}"
        else:
            assert math.isclose(got[name], value, rel_tol=1e-12, abs_tol=0.0), (
                f"{where}: {name} = {got[name]!r}, expected {value!r} (rel 1e-12)"
            )


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_metrics_are_exact_at_any_world_size(nproc):
    results = run_distributed(evaluate_every_size, SIZES, nproc=nproc)

    for n in SIZES:
        want = reference(n)
        # The shards are the EvalSampler's: every sample once, none padded.
        shards = [rank_result[n]["indices"] for rank_result in results]
        assert sorted(i for shard in shards for i in shard) == list(range(n))
        if n < nproc:
            assert any(len(shard) == 0 for shard in shards), (
                "the case of a rank without samples did not occur"
            )
        for rank, rank_result in enumerate(results):
            where = f"n={n}, rank {rank} of {nproc}"
            _assert_metrics_equal(rank_result[n]["cls"], want["cls"], {"acc", "top2"}, where)
            _assert_metrics_equal(rank_result[n]["reg"], want["reg"], set(), where)


def test_reference_discriminates_between_sizes():
    """The reference values are not all alike, so agreement with them means something."""
    refs = [reference(n) for n in SIZES]
    assert len({ref["cls"]["acc"] for ref in refs}) > 1
    assert len({ref["reg"]["mse"] for ref in refs}) == len(SIZES)
    assert 0.0 < refs[0]["cls"]["acc"] < refs[0]["cls"]["top2"] < 1.0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_padding_sampler_with_ignite_accuracy_is_wrong_where_unison_is_exact():
    # Only sample 0 is predicted right: a sampler that pads with sample 0 counts it twice.
    labels = [0, 1, 0, 1, 0]
    predicted = [0, 0, 1, 0, 1]
    scores = [[1.0, 0.0] if p == 0 else [0.0, 1.0] for p in predicted]
    truth = sum(p == y for p, y in zip(predicted, labels, strict=True)) / len(labels)

    padded_indices = [
        i for rank in range(2) for i in DistributedSampler(range(5), num_replicas=2, rank=rank, shuffle=False)
    ]
    assert len(padded_indices) == 6  # one sample seen twice
    padded_accuracy = sum(predicted[i] == labels[i] for i in padded_indices) / len(padded_indices)
    assert padded_accuracy != truth

    results = run_distributed(padded_sampler_accuracy, scores, labels, nproc=2)
    for result in results:
        assert result["unison_exact"] == truth
        assert result["ignite_padded"] == pytest.approx(padded_accuracy, abs=1e-12)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_evaluation_with_four_metrics_issues_one_all_reduce(nproc):
    sizes = (7, 2)
    results = run_distributed(count_evaluation_collectives, sizes, nproc == 2, nproc=nproc)
    for rank, result in enumerate(results):
        for n in sizes:
            calls = result[("unison", n)]["calls"]
            assert calls["all_reduce"] == 1, f"rank {rank}, n={n}: {calls}"
            others = {name: count for name, count in calls.items() if name != "all_reduce" and count}
            assert others == {}, f"rank {rank}, n={n}: unexpected collectives {others}"
            assert result[("unison", n)]["metrics"]["acc"] == reference(n)["cls"]["acc"]
    if nproc == 3:
        assert results[2][("unison", 2)]["local"] == 0  # the rank without samples joined the single sync
    else:
        for rank, result in enumerate(results):
            theirs = result[("ignite", 7)]
            total = sum(theirs["calls"].values())
            assert total >= 4, f"rank {rank}: ignite's four metrics issued {theirs['calls']}"
            assert total > 1
            # Same data, same answer: the comparison is between equals.
            assert theirs["metrics"]["acc"] == pytest.approx(
                result[("unison", 7)]["metrics"]["acc"], abs=1e-12
            )
