"""Small CPU tensors in the objects a checkpoint gathers travel as raw bytes
(``unison.distributed.packed``), and come back equal."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison.checkpoint.state import capture_rng
from unison.distributed.packed import Packed, packed, unpacked

DTYPES = [torch.uint8, torch.int8, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES += [torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 4), max_size=3),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_tensor_comes_back_equal_in_value_dtype_and_shape(dtype, shape, transpose, seed):
    gen = torch.Generator().manual_seed(seed)
    tensor = (torch.rand(shape, generator=gen) * 100).to(dtype)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # not contiguous
    back = unpacked(pickle.loads(pickle.dumps(packed({"t": [tensor, (tensor, 3)]}))))
    for got in (back["t"][0], back["t"][1][0]):
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor)
    assert back["t"][1][1] == 3


def test_the_random_states_a_save_gathers_pickle_without_torchs_tensor_reducer(monkeypatch):
    """Counted: torch's reducer writes a small archive per tensor, which the gather of every
    save paid three times a rank."""
    reduced: list[int] = []
    real = torch.Tensor.__reduce_ex__

    def counted(self, protocol):
        reduced.append(1)
        return real(self, protocol)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", counted)
    state = capture_rng()
    pickle.dumps(state)
    assert len(reduced) >= 3  # without packing
    reduced.clear()
    back = unpacked(pickle.loads(pickle.dumps(packed(state))))
    assert reduced == []
    assert torch.equal(back["torch"], state["torch"]) and back["python"]["gauss"] == state["python"]["gauss"]


def test_only_plain_cpu_tensors_are_packed_and_containers_keep_their_type():
    weight = torch.nn.Parameter(torch.ones(2))
    sparse = torch.eye(2).to_sparse()
    obj = OrderedDict(w=weight, s=sparse, t=torch.zeros(2), n=None)
    out = packed(obj)
    assert type(out) is OrderedDict and out["w"] is weight and out["s"] is sparse and out["n"] is None
    assert isinstance(out["t"], Packed)
    assert type(unpacked(out)) is OrderedDict
