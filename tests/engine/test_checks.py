"""The data a trainer is given is checked before its first batch: a stream in a plain DataLoader
that would be read whole by every rank, or by every loader worker, is refused on every rank at
once, naming the fix; a stream that shards itself is trained as is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stream_check_workers import train_on  # noqa: E402

from unison.testing import run_distributed  # noqa: E402


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stream_every_rank_would_read_whole_is_refused_on_every_rank():
    results = run_distributed(train_on, "whole", 8, nproc=2, timeout=90)
    for rank, result in enumerate(results):
        message = result["error"]
        assert message is not None, f"rank {rank} trained on {result['seen']}: every rank read every sample"
        assert "_stream_check_workers.WholeStream" in message and "while 2 ranks run" in message
        assert "prepare_loaders" in message and "shard_stream" in message and "shards_itself" in message
        assert result["seen"] == [], "refused after training began"


def test_a_stream_every_worker_would_read_whole_is_refused():
    result = train_on("whole", 8, num_workers=2)
    message = result["error"]
    assert message is not None, f"trained on {result['seen']}: each sample twice an epoch"
    assert "num_workers=2" in message and "WholeStream" in message
    assert "shard_stream" in message and "shards_itself = True" in message
    assert result["seen"] == []


def test_one_process_without_workers_reads_a_plain_stream_as_is():
    assert train_on("whole", 5)["seen"] == [0, 1, 2, 3, 4]
    assert train_on("whole", 5, num_workers=1)["seen"] == [0, 1, 2, 3, 4], "one worker reads it once"


def test_a_stream_that_shards_itself_by_worker_is_accepted():
    result = train_on("own", 10, num_workers=2)
    assert result["error"] is None and result["seen"] == list(range(10))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stream_that_shards_itself_by_rank_and_worker_is_accepted():
    results = run_distributed(train_on, "own", 12, 2, nproc=2, timeout=90)
    assert all(r["error"] is None for r in results), [r["error"] for r in results]
    assert sorted(i for r in results for i in r["seen"]) == list(range(12)), "each sample once"
