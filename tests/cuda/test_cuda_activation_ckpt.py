"""Activation checkpointing on the GPU: under bf16 autocast, with DDP's placement and FSDP2,
checkpointed blocks train as the plain ones do and hold less memory during a step."""

from __future__ import annotations

import pytest
import torch
from _cuda_ac_workers import both
from _cuda_workers import BACKEND

from unison.testing import run_distributed

ITERATIONS, WIDTH, BLOCKS, BATCH = 4, 512, 6, 2048


@pytest.mark.cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpointed_blocks_train_alike_and_hold_less_memory_on_the_gpu(strategy):
    (out,) = run_distributed(
        both, strategy, ITERATIONS, WIDTH, BLOCKS, BATCH, nproc=1, backend=BACKEND, timeout=150
    )
    plain, ac = out["plain"], out["ac"]
    assert plain["losses"] == pytest.approx(ac["losses"], rel=1e-5, abs=1e-6)
    assert list(plain["weights"]) == list(ac["weights"]), "the checkpointed model's keys are the plain ones"
    for name, value in plain["weights"].items():
        assert torch.allclose(value, ac["weights"][name], rtol=1e-4, atol=1e-5), name
    # what six blocks keep for backward, against what one block keeps while it is recomputed
    assert ac["peak"] < 0.6 * plain["peak"], (ac["peak"], plain["peak"])
