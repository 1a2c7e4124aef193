"""At 8 ranks a rank issues as many collectives as at 2: none per iteration, one per sync point,
one per evaluation, a fixed few per save (counted, not timed; benchmarks/scale.py goes to 16)."""

from __future__ import annotations

import pytest
from _scale_workers import collectives_by_part

from unison.testing import run_distributed

ITERS, SYNC_EVERY = 6, 2
# what one save issues on every rank: the ranks' states gathered on rank 0, the outcome shared
SAVE = {"gather_object": 1, "broadcast_object_list": 1}


def _check(results: list[dict], world: int) -> None:
    assert [r["world_size"] for r in results] == [world] * world
    for rank, r in enumerate(results):
        assert r["iterations"] == [{}] * ITERS, f"rank {rank}: a collective inside an iteration"
        in_epoch = [calls for end, calls in r["sync_points"] if not end]
        epoch_end = [calls for end, calls in r["sync_points"] if end]
        # sync points after iterations 2 and 4 (the one after 6 is the epoch's end)
        assert in_epoch == [{"all_reduce": 1}] * (ITERS // SYNC_EVERY - 1), f"rank {rank}: {r['sync_points']}"
        assert epoch_end == [{"all_reduce": 1}], f"rank {rank}: {r['sync_points']}"
        assert r["evaluation"] == {"all_reduce": 1}, f"rank {rank}: two metrics, one collective"
        assert r["save"] == SAVE, f"rank {rank}: {r['save']}"
    assert len(results[0]["saved"]) == 1  # the save wrote (the control: the counted block did save)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_collectives_per_part_at_two_ranks(tmp_path):
    _check(run_distributed(collectives_by_part, str(tmp_path), ITERS, SYNC_EVERY, nproc=2, timeout=150), 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_collectives_per_part_at_eight_ranks_are_those_at_two(tmp_path):
    _check(run_distributed(collectives_by_part, str(tmp_path), ITERS, SYNC_EVERY, nproc=8, timeout=840), 8)
