"""What a checkpoint holds: generator states, weights without DDP's prefix, CPU copies."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from unison.checkpoint import capture_rng, load_model_state, model_state, restore_rng
from unison.checkpoint.state import to_cpu_copy


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3))


def _through_weights_only(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_restored_generators_repeat_the_same_draws_after_a_weights_only_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    random.gauss(0, 1)  # leaves a cached gauss value in Python's state
    state = _through_weights_only(capture_rng())
    expected = _draws()
    _draws()  # move every generator on
    restore_rng(state)
    again = _draws()
    assert expected[:3] == again[:3] and torch.equal(expected[3], again[3])


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_capturing_draws_nothing_from_any_generator():
    _seed_all(7)
    undisturbed = _draws()
    _seed_all(7)
    capture_rng()
    after_capture = _draws()
    assert undisturbed[:3] == after_capture[:3] and torch.equal(undisturbed[3], after_capture[3])


# --- weights and DDP ------------------------------------------------------------------------------


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of one gloo rank in this process, for a real DistributedDataParallel."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _same(state: dict, expected: dict) -> bool:
    return sorted(state) == sorted(expected) and all(torch.equal(state[k], expected[k]) for k in expected)


def test_model_state_has_no_ddp_prefix(one_rank_group):
    ddp = DistributedDataParallel(_model(0))
    assert all(k.startswith("module.") for k in ddp.state_dict())
    state = model_state(ddp)
    assert _same(state, _model(0).state_dict())


@pytest.mark.parametrize("prefixed", [True, False], ids=["saved-with-module-prefix", "saved-without"])
@pytest.mark.parametrize("into_ddp", [False, True], ids=["into-plain", "into-ddp"])
def test_weights_load_with_or_without_the_prefix_into_plain_or_ddp_models(one_rank_group, prefixed, into_ddp):
    source = _model(1).state_dict()
    saved = {("module." + k if prefixed else k): v for k, v in source.items()}
    saved = _through_weights_only(saved)
    target = _model(2)
    assert not _same(target.state_dict(), source), "source and target start equal: the test is blind"
    if into_ddp:
        target = DistributedDataParallel(target)
    load_model_state(target, saved)
    assert _same(model_state(target), source)


def test_loading_weights_of_another_model_fails_loudly():
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        load_model_state(_model(0), nn.Linear(3, 4).state_dict())


# --- CPU copies for asynchronous writes -----------------------------------------------------------


def test_to_cpu_copy_is_deep_and_keeps_the_structure():
    original = {
        "w": torch.ones(3),
        "list": [torch.zeros(2), 5],
        "tuple": (torch.arange(2), "s"),
        "none": None,
    }
    copy = to_cpu_copy(original)
    original["w"].add_(1)
    original["list"][0].add_(1)
    original["tuple"][0].add_(1)
    assert torch.equal(copy["w"], torch.ones(3)) and torch.equal(copy["list"][0], torch.zeros(2))
    assert torch.equal(copy["tuple"][0], torch.arange(2))
    assert copy["list"][1] == 5 and copy["tuple"][1] == "s" and copy["none"] is None
    assert isinstance(copy["tuple"], tuple) and isinstance(copy["list"], list)
    assert copy["w"].device.type == "cpu" and not copy["w"].requires_grad
