"""The finite check of a save: a NaN or an infinity anywhere is found, and finite weights are
cleared by their sums, without a tensor of their size built."""

from __future__ import annotations

import torch

import unison.checkpoint.verify as verify_module
from unison.checkpoint.verify import first_non_finite


def test_finite_weights_are_cleared_by_their_sums_alone(monkeypatch):
    checked: list[int] = []
    real = torch.isfinite

    def isfinite(tensor):
        checked.append(tensor.numel())
        return real(tensor)

    monkeypatch.setattr(verify_module.torch, "isfinite", isfinite)
    objects = {"model": {"w": torch.randn(1000, 100), "b": torch.randn(100)}, "opt": {"m": [torch.randn(50)]}}
    assert first_non_finite(objects) is None
    assert checked and max(checked) == 1  # one flag per tensor: no pass that builds a bool per element


def test_a_nan_or_an_infinity_is_found_first_in_key_order_and_an_overflowing_sum_is_not_one():
    big = torch.full((8,), 3e38)  # finite values whose float32 sum overflows
    assert torch.isinf(big.sum()) and first_non_finite({"model": {"w": big}}) is None
    half = torch.full((100,), 60000.0, dtype=torch.float16)
    assert first_non_finite({"model": {"w": half}}) is None
    nan, inf = torch.zeros(5), torch.zeros(3, 3)
    nan[3], inf[1, 2] = float("nan"), -float("inf")
    objects = {"model": {"a": big, "b": torch.ones(4), "c": inf}, "ema": {"d": nan}}
    assert first_non_finite(objects) == "model.c"
    assert first_non_finite({"ema": {"d": nan}, "model": {"a": big}}) == "ema.d"
    z = torch.zeros(2, dtype=torch.complex64)
    z[1] = complex(float("inf"), 0)
    assert first_non_finite({"x": {"i": torch.arange(3), "z": z}}) == "x.z"
