"""A checkpoint's data positions are checked before anything is loaded from them.

A crafted or damaged file could otherwise put the data at a negative position (the epoch
replays) or past its end (the epoch is empty), silently. Each refusal names the file, the key
path, the value and what was expected.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from unison.checkpoint import CheckpointError
from unison.checkpoint.state import check_checkpoint
from unison.distributed import shard_stream


def valid() -> dict[str, Any]:
    """A mid-epoch checkpoint of 2 ranks with both kinds of data position, as a save writes them."""
    loader_state = {
        "_sampler_iter_state": {"samples_yielded": 4},
        "_sampler_iter_yielded": 2,
        "_num_yielded": 2,
        "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
        "dataset_state": {"epoch": 0, "consumed": 8},
        "_iterator_finished": False,
    }
    return {
        "meta": {
            "format": 1,
            "world_size": 2,
            "mid_epoch": True,
            "iteration": 2,
            "epoch": 0,
            "epoch_length": 5,
        },
        "objects": {"model": {}},
        "trainer": {"epoch": 0, "iteration": 2, "epoch_length": 5, "unison": {"position": [0, 2]}},
        "sampler": {
            "epoch": 0,
            "consumed": 4,
            "dataset_size": 20,
            "world_size": 2,
            "consumed_by_rank": [4, 4],
        },
        "data": {
            "kind": "stateful",
            "source": "torchdata.StatefulDataLoader",
            "scope": "rank",
            "elastic": False,
            "not_elastic": "",
            "world_size": 2,
            "by_rank": [loader_state, copy.deepcopy(loader_state)],
        },
    }


def with_value(path: list[Any], value: Any) -> dict[str, Any]:
    state = valid()
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return state


def test_a_valid_checkpoint_passes():
    assert check_checkpoint(valid(), source="ckpt.pt", names=["model"], world_size=2) is None


@pytest.mark.parametrize(
    ("path", "value", "shown", "expected"),
    [
        (
            ["data", "by_rank", 1, "dataset_state", "consumed"],
            -4,
            "data.by_rank[1].dataset_state.consumed",
            "-4",
        ),
        (["data", "by_rank", 0, "_num_yielded"], -1, "data.by_rank[0]._num_yielded", "-1"),
        (["data", "by_rank", 0, "dataset_state", "epoch"], "3", "data.by_rank[0].dataset_state.epoch", "'3'"),
        (["data", "by_rank"], [{}], "data.by_rank", "1 entries"),
        (["data", "world_size"], 3, "data.world_size", "3"),
        (["data", "scope"], "everywhere", "data.scope", "'everywhere'"),
        (["data", "elastic"], "yes", "data.elastic", "'yes'"),
        (["data"], [1, 2], "data", "list"),
        (["sampler", "consumed"], -6, "sampler.consumed", "-6"),
        (["sampler", "consumed"], 10**12, "sampler.consumed", "1000000000000"),
        (["sampler", "consumed_by_rank"], [4], "sampler.consumed_by_rank", "1 entries"),
        (["sampler", "consumed_by_rank"], [4, 99], "sampler.consumed_by_rank[1]", "99"),
        (["trainer", "unison", "position"], [0, -3], "trainer.unison.position[1]", "-3"),
        (["trainer", "unison", "position"], [0, 500], "trainer.unison.position[1]", "500"),
    ],
)
def test_a_bad_data_position_is_refused_naming_the_entry(path, value, shown, expected):
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(with_value(path, value), source="ckpt.pt", names=["model"], world_size=2)
    message = str(err.value)
    assert "ckpt.pt" in message and shown in message and expected in message, message
    assert "expected" in message, message


def test_a_stream_position_beyond_its_source_is_refused():
    stream = shard_stream(list(range(10)), rank=0, world_size=2)
    for consumed in (-2, 11):
        with pytest.raises(ValueError, match=rf"consumed.*{consumed}.*0 and 10"):
            stream.load_state_dict({"epoch": 0, "consumed": consumed})
    with pytest.raises(ValueError, match=r"epoch.*-1"):
        stream.load_state_dict({"epoch": -1, "consumed": 2})
    stream.load_state_dict({"epoch": 0, "consumed": 10})  # the end of the epoch: nothing left
    assert list(stream) == []
