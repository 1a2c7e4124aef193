"""DDP and FSDP2 with CUDA tensors, and ``torch.compile`` on the GPU.

DDP at the same world size is FSDP2's truth (tests/distributed/test_fsdp.py is the CPU
version); the eager model is the compiled one's.
"""

from __future__ import annotations

import pytest
from _cuda_params import RANKS
from _cuda_workers import BACKEND, DEVICE_TYPE, compiled_training, largest_difference, train_strategy

from unison.testing import run_distributed

ITERATIONS = 6
TRAINING = {"accumulation_steps": 2, "clip_grad_norm": 0.5}


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", RANKS)
def test_fsdp_trains_to_the_ddp_parameters_on_gpus(nproc):
    ddp = run_distributed(
        train_strategy, "ddp", ITERATIONS, nproc=nproc, backend=BACKEND, timeout=120, **TRAINING
    )
    fsdp = run_distributed(
        train_strategy, "fsdp", ITERATIONS, nproc=nproc, backend=BACKEND, timeout=120, **TRAINING
    )
    for rank in range(nproc):
        assert ddp[rank]["parameter_device"] == fsdp[rank]["parameter_device"] == f"{DEVICE_TYPE}:{rank}"
        assert fsdp[rank]["sharded"] is (nproc > 1)
        assert (ddp[rank]["wrapped"] == "FixedBucketsDDP") is (nproc > 1)
        assert largest_difference(fsdp[rank]["state"], ddp[rank]["state"]) < 1e-5, f"rank {rank}"
        assert largest_difference(fsdp[rank]["state"], fsdp[0]["state"]) == 0.0  # every rank, one model
        assert largest_difference(ddp[rank]["state"], ddp[0]["state"]) == 0.0
    if nproc > 1:
        # the gradients were reduced over the ranks: one rank alone ends elsewhere
        alone = run_distributed(
            train_strategy, "ddp", ITERATIONS, nproc=1, backend=BACKEND, timeout=120, **TRAINING
        )
        assert largest_difference(fsdp[0]["state"], alone[0]["state"]) > 1e-4


@pytest.mark.cuda(gpus=2)
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp_with_cpu_offload_trains_to_the_ddp_parameters():
    """``parallel.fsdp.cpu_offload`` (CUDA only): shards live in CPU memory, compute on the GPU."""
    ddp = run_distributed(
        train_strategy, "ddp", ITERATIONS, nproc=2, backend=BACKEND, timeout=120, **TRAINING
    )
    offloaded = run_distributed(
        train_strategy,
        "fsdp",
        ITERATIONS,
        fsdp={"cpu_offload": True},
        nproc=2,
        backend=BACKEND,
        timeout=120,
        **TRAINING,
    )
    for rank in range(2):
        assert offloaded[rank]["sharded"] is True
        assert offloaded[rank]["parameter_device"] == "cpu"  # the shards, offloaded
        assert largest_difference(offloaded[rank]["state"], ddp[rank]["state"]) < 1e-5, f"rank {rank}"


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", RANKS)
def test_compiled_model_trains_like_the_eager_one_and_keeps_its_keys(nproc):
    results = run_distributed(compiled_training, ITERATIONS, nproc=nproc, backend=BACKEND, timeout=280)
    for rank, result in enumerate(results):
        assert result["is_compiled"] and result["graphs"] > 0, f"rank {rank}: nothing was compiled"
        assert result["parameter_device"] == f"{DEVICE_TYPE}:{rank}"
        # checkpoints keep the plain module's keys: no _orig_mod. prefix, the class unchanged
        assert result["compiled_keys"] == result["plain_keys"]
        assert result["unwrapped_type"] == "Sequential"
        assert not any("_orig_mod" in key for key in result["wrapped_keys"])
        # the compiled kernels compute what the eager ones do, to float tolerance
        assert largest_difference(result["compiled"], result["eager"]) < 1e-4, f"rank {rank}"
