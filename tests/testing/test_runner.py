"""run_distributed: per-rank results in order, and failures that say which rank and why."""

from __future__ import annotations

import uuid

import pytest
import torch
from _runner_workers import (
    exit_abruptly,
    killed_by_signal,
    raise_on_rank,
    rank_and_args,
    read_environment,
    return_unpicklable,
)

from unison.distributed import RankFailedError
from unison.testing import run_distributed


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_returns_each_ranks_result_in_rank_order(nproc):
    results = run_distributed(rank_and_args, 1, "two", nproc=nproc, key=[3])
    assert [r["rank"] for r in results] == list(range(nproc))
    expected_sum = float(sum(range(nproc)))
    for rank, result in enumerate(results):
        assert result["world_size"] == nproc
        assert result["sum_of_ranks"] == expected_sum
        assert result["args"] == (1, "two") and result["kwargs"] == {"key": [3]}
        assert torch.equal(result["tensor"], torch.full((2,), float(rank)))


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_workers_exception_is_re_raised_with_its_traceback():
    with pytest.raises(RankFailedError) as err:
        run_distributed(raise_on_rank, 1, "the value 17 is not allowed", nproc=2)
    assert err.value.rank == 1 and err.value.world_size == 2
    message = str(err.value)
    assert message.startswith("rank 1 of 2 failed")
    assert "Traceback (most recent call last)" in message
    assert "ValueError: the value 17 is not allowed" in message
    assert "raise_on_rank" in message  # the frame that raised
    assert isinstance(err.value, RuntimeError)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_an_unpicklable_result_gives_a_clear_error():
    with pytest.raises(RankFailedError) as err:
        run_distributed(return_unpicklable, nproc=2)
    message = str(err.value)
    assert "return_unpicklable" in message
    assert "lock" in message  # the type that was returned
    assert "cannot be pickled" in message and "Return plain data" in message


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_that_exits_or_is_killed_is_reported():
    with pytest.raises(RankFailedError) as err:
        run_distributed(exit_abruptly, 7, nproc=2)
    assert err.value.rank == 1
    assert "exit code 7" in str(err.value)

    with pytest.raises(RankFailedError) as err:
        run_distributed(killed_by_signal, nproc=2)
    assert err.value.rank == 0
    assert "SIGKILL" in str(err.value)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_ranks_see_the_environment_of_the_call(monkeypatch):
    name = "UNISON_TEST_RUNNER_MARKER"
    # A first run starts the fork server, with the environment of that moment.
    assert run_distributed(read_environment, name, nproc=2) == [None, None]
    value = uuid.uuid4().hex
    monkeypatch.setenv(name, value)
    assert run_distributed(read_environment, name, nproc=2) == [value, value], (
        "ranks did not see an environment variable set before the call"
    )
