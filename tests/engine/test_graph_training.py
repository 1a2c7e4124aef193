"""A graph network over torch_geometric batches, through prepare_loaders, create_trainer and
create_evaluator: N ranks train as one process with the global batch, evaluation is exact at
1, 2 and 3 ranks, and a mid-epoch resume ends where the uninterrupted run ends."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_geometric")

import torch  # noqa: E402
from _graph_workers import evaluate, resume, train, truth, two_rank_job  # noqa: E402

from unison.testing import run_distributed  # noqa: E402

PER_RANK = 4


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    folder = tmp_path_factory.mktemp("graph_resume")
    return run_distributed(two_rank_job, str(folder), PER_RANK, nproc=2, timeout=150)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_two_ranks_train_as_one_process_with_twice_the_batch(two_ranks: list[dict]) -> None:
    reference = train(per_rank=2 * PER_RANK)
    assert reference["graphs_per_batch"] == [2 * PER_RANK] * 6, "a batch holds graphs, counted by num_graphs"
    assert not torch.allclose(reference["params"], reference["initial"], atol=1e-3), "training did not move"
    for rank, result in enumerate(r["train"] for r in two_ranks):
        assert result["graphs_per_batch"] == [PER_RANK] * 6, f"rank {rank}"
        torch.testing.assert_close(result["params"], reference["params"], rtol=0, atol=1e-5, msg=f"rank {rank}")
        assert result["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert torch.equal(two_ranks[0]["train"]["params"], two_ranks[1]["train"]["params"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_evaluation_is_one_process_over_every_graph_at_1_2_and_3_ranks(two_ranks: list[dict]) -> None:
    expected = truth()
    three = run_distributed(evaluate, nproc=3, timeout=150)
    results = {"1": evaluate(), **{f"2:{r}": x["evaluate"] for r, x in enumerate(two_ranks)}}
    results.update({f"3:{r}": x for r, x in enumerate(three)})
    for where, metrics in results.items():
        assert metrics == pytest.approx(expected, rel=1e-6, abs=1e-7), where


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_mid_epoch_resume_ends_where_the_uninterrupted_run_ends(two_ranks: list[dict], tmp_path) -> None:
    runs = {"1": resume(str(tmp_path), stop=3), **{f"2:{r}": x["resume"] for r, x in enumerate(two_ranks)}}
    for where, run in runs.items():
        assert 0 < run["stopped"] % run["epoch_length"], f"{where}: the stop is not mid-epoch"
        assert run["resumed_at"] == run["stopped"], where
        assert run["iterations"][0] == run["iterations"][1], where
        torch.testing.assert_close(run["resumed"], run["uninterrupted"], rtol=0, atol=1e-6, msg=where)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_batches_filled_by_a_node_budget_resume_mid_epoch_counted_in_graphs(tmp_path) -> None:
    run = resume(str(tmp_path), stop=3, node_budget=20)
    assert run["epoch_length"] > 4 and 0 < run["stopped"] % run["epoch_length"]
    assert run["resumed_at"] == run["stopped"]
    torch.testing.assert_close(run["resumed"], run["uninterrupted"], rtol=0, atol=1e-6)
