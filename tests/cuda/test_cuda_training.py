"""Training on one GPU: mixed precision against plain ``torch.autocast`` loops, pinned-memory
loaders against unpinned ones, and no host-device synchronisation between sync points."""

from __future__ import annotations

import pytest
import torch
from _cuda_params import RANKS
from _cuda_workers import (
    BACKEND,
    DEVICE_TYPE,
    SYNC_MESSAGE,
    amp_runs,
    flat,
    hot_path_run,
    largest_difference,
    pinned_loaders,
)

from unison.testing import run_distributed

ITERATIONS = 8


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_bf16_trainer_matches_a_plain_autocast_loop():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 support")
    result = amp_runs("bf16", ITERATIONS)
    assert result["parameter_device"].startswith(DEVICE_TYPE)
    assert result["scaler"] is None  # bf16 has fp32's range: no loss scaling
    assert result["unison_steps"] == result["plain_steps"] == list(range(1, ITERATIONS + 1))
    assert largest_difference(result["unison"], result["plain"]) <= 1e-6
    # the control: autocast changed the numbers, so the comparison above saw bf16 arithmetic
    assert largest_difference(result["plain"], result["full_precision"]) > 1e-5


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_fp16_trainer_skips_the_update_with_inf_gradients_as_grad_scaler_does():
    inf_at = 3  # 0-based: the 4th batch overflows fp16
    result = amp_runs("fp16", ITERATIONS, inf_at=inf_at)
    assert result["parameter_device"].startswith(DEVICE_TYPE)
    assert result["scaler"] == "GradScaler" and result["scaler_enabled"]
    # the same updates ran, the overflowing one skipped in both
    assert result["unison_steps"] == result["plain_steps"]
    assert inf_at + 1 not in result["unison_steps"]
    assert len(result["unison_steps"]) < ITERATIONS
    # the same scale after backing off, and the same weights, all finite
    assert result["unison_scale"] == result["plain_scale"] < result["initial_scale"]
    assert largest_difference(result["unison"], result["plain"]) <= 1e-6
    assert torch.isfinite(flat(result["unison"])).all()


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pinned_loaders_yield_pinned_batches_that_copy_and_train_alike(num_workers):
    result = pinned_loaders(num_workers)
    assert result["pinned"] and all(result["pinned"]), result["pinned"]
    assert all(result["same_batches"])  # pinning changes where a batch lives, not what it holds
    assert all(result["copies_equal"])  # a non-blocking copy from pinned memory holds the values
    assert result["copied_to"] == [f"{DEVICE_TYPE}:0"]
    # non_blocking copies from pinned memory train to the weights of blocking copies
    assert largest_difference(result["trained_pinned"], result["trained_plain"]) == 0.0


HOT_PATHS = {
    "plain": {},
    "bf16-accumulate-clip": {"amp": "bf16", "accumulation_steps": 2, "clip_grad_norm": 0.5},
}
EPOCHS, EPOCH_LENGTH, SYNC_EVERY = 2, 10, 3


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", RANKS)
@pytest.mark.parametrize("config", HOT_PATHS.values(), ids=HOT_PATHS.keys())
def test_iterations_never_synchronise_with_the_host_only_sync_points_do(config, nproc):
    results = run_distributed(
        hot_path_run, EPOCHS, EPOCH_LENGTH, SYNC_EVERY, nproc=nproc, backend=BACKEND, timeout=90, **config
    )
    for rank, result in enumerate(results):
        # every iteration ran under set_sync_debug_mode("error"): one synchronisation would have raised
        assert result["iterations"] == EPOCHS * EPOCH_LENGTH, f"rank {rank}"
        # sync points ran inside the epochs too, and they do read the device (under "warn")
        assert result["sync_points"] > 2 * EPOCHS, f"rank {rank}"
        assert result["synchronisations_outside_iterations"] >= result["sync_points"], f"rank {rank}"
        assert result["loss"] == result["loss"]  # a number: the epoch's loss was read at its sync point


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_positive_control_a_read_inside_an_iteration_fails_the_run():
    with pytest.raises(RuntimeError, match=SYNC_MESSAGE):
        hot_path_run(1, 4, SYNC_EVERY, read_in_iteration=True)
