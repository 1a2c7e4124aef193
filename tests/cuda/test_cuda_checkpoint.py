"""A checkpoint written from GPU training loads onto the CPU, and resumes onto the GPU exactly.

Run A trains uninterrupted; run B stops inside epoch 2 and saves; run B', built afresh,
resumes B's file and must end where A ends (its dropout masks come from the CUDA generator
the checkpoint restores); a control run with other masks must not.
"""

from __future__ import annotations

import math

import pytest
import torch
from _cuda_params import RANKS
from _cuda_workers import (
    BACKEND,
    CKPT_BATCH,
    CKPT_SIZE,
    DEVICE_TYPE,
    checkpoint_roundtrip,
    largest_difference,
)

from unison.testing import run_distributed


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", RANKS)
def test_checkpoint_saved_on_gpu_loads_on_cpu_and_resumes_on_gpu(nproc, tmp_path):
    stop = math.ceil(math.ceil(CKPT_SIZE / nproc) / CKPT_BATCH) + 1  # the 2nd iteration of epoch 2
    results = run_distributed(
        checkpoint_roundtrip, str(tmp_path), stop, nproc=nproc, backend=BACKEND, timeout=150
    )
    for rank, result in enumerate(results):
        assert result["stopped"] == stop and result["resumed"] is not None, f"rank {rank}"
        assert result["iterations"][0] == result["iterations"][1]
        # resumed onto this rank's GPU: weights and the optimizer's moments
        assert result["after_resume"]["parameters"] == f"{DEVICE_TYPE}:{rank}"
        assert result["after_resume"]["optimizer_state"] == [f"{DEVICE_TYPE}:{rank}"]
        assert largest_difference(result["b"], result["a"]) <= 1e-6, f"rank {rank}"
        assert largest_difference(result["control"], result["a"]) > 1e-4, "dropout masks do not matter: blind"

    file = results[0]["file"]
    assert file["devices_with_map_location"] == ["cpu"]  # torch.load(weights_only=True, map_location="cpu")
    # load_checkpoint reads the weights A ended with, and a CPU model takes them
    assert largest_difference(file["model"], results[0]["a"]) == 0.0
    assert largest_difference(file["cpu_model_state"], results[0]["a"]) == 0.0
    assert all(t.device == torch.device("cpu") for t in file["model"].values())
    assert file["forward_difference"] < 1e-5  # the CPU copy computes what the GPU model does
