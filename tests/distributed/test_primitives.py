"""sync_bool, first_rank, broadcast_object, rank_zero_only and all_reduce_sum on 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch
from _dist_workers import exercise_primitives, rank_tensors

from unison.distributed import (
    all_reduce_sum,
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed,
    rank_zero_only,
    sync_bool,
)
from unison.distributed.primitives import first_rank
from unison.testing import run_distributed


def _flag_patterns(world_size: int) -> list[list[bool]]:
    return [
        [False] * world_size,
        [True] * world_size,
        [rank == 0 for rank in range(world_size)],
        [rank == world_size - 1 for rank in range(world_size)],
        [rank != 0 for rank in range(world_size)],
        [rank % 2 == 1 for rank in range(world_size)],
    ]


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_primitives_on_several_ranks(nproc):
    patterns = _flag_patterns(nproc)
    results = run_distributed(exercise_primitives, patterns, nproc=nproc)

    for rank, result in enumerate(results):
        assert result["placement"] == (rank, nproc, rank, True, "cpu")

        # sync_bool: the same, agreed value on every rank, by the rule of each mode.
        for pattern, agreed in zip(patterns, result["sync_bool"], strict=True):
            assert agreed == {"any": any(pattern), "all": all(pattern), "rank_zero": pattern[0]}, pattern

        # first_rank: the lowest rank whose flag is set (None for none), in one all-reduce a pattern.
        lowest = [next((r for r, flag in enumerate(pattern) if flag), None) for pattern in patterns]
        assert result["first_rank"] == lowest
        assert result["first_rank_calls"] == {"all_reduce": len(patterns)}

        # broadcast_object: every rank holds the source's object.
        for src in range(nproc):
            assert result["broadcast"][src] == {"from": src, "payload": [src] * 3}

        # rank_zero_only: runs on rank 0 only, returns None elsewhere, propagates rank 0's error.
        zero = result["rank_zero_only"]
        assert zero["name"] == "side_effect"
        if rank == 0:
            assert zero["returned"] == 42 and zero["calls"] == [21]
            assert zero["raised"] == "raised on rank 0"
        else:
            assert zero["returned"] is None and zero["calls"] == []
            assert zero["raised"] is None

        # all_reduce_sum: the sums over ranks of tensors of several sizes, in one all-reduce.
        expected = [
            torch.stack([rank_tensors(r)[i].double() for r in range(nproc)]).sum(dim=0).tolist()
            for i in range(3)
        ]
        reduced = result["all_reduce_sum"]
        assert reduced["sums"] == expected
        assert reduced["dtypes"] == ["torch.float64"] * 3
        assert reduced["devices"] == ["cpu"] * 3
        assert reduced["empty"] == []
        others = {name: n for name, n in reduced["calls"].items() if name != "all_reduce" and n}
        assert reduced["calls"]["all_reduce"] == 1 and others == {}


def test_primitives_without_process_group():
    assert (get_rank(), get_world_size(), is_distributed()) == (0, 1, False)
    for flag in (True, False):
        for mode in ("any", "all", "rank_zero"):
            assert sync_bool(flag, mode) is flag
    assert (first_rank(True), first_rank(False)) == (0, None)
    obj = {"a": [1, 2]}
    assert broadcast_object(obj) is obj

    @rank_zero_only
    def double(x: int) -> int:
        return 2 * x

    assert double(4) == 8

    tensors = rank_tensors(0)
    sums = all_reduce_sum(tensors)
    assert [s.tolist() for s in sums] == [t.double().tolist() for t in tensors]
    assert all(s.dtype == torch.float64 for s in sums)


def test_sync_bool_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode") as err:
        sync_bool(True, "majority")  # type: ignore[arg-type]
    assert "'majority'" in str(err.value)


def test_rank_zero_only_propagates_exceptions_on_rank_zero():
    @rank_zero_only
    def fails() -> None:
        raise KeyError("from rank zero")

    with pytest.raises(KeyError, match="from rank zero"):
        fails()
