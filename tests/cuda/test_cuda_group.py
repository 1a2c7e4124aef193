"""An NCCL process group: each rank computes on ``cuda:LOCAL_RANK``, and unison's collectives
run on that GPU (NCCL takes no CPU tensors), at one rank on one GPU and at two on two."""

from __future__ import annotations

import pytest
from _cuda_params import RANKS
from _cuda_workers import BACKEND, DEVICE_TYPE, group_facts

from unison.testing import run_distributed


@pytest.mark.cuda
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", RANKS)
def test_each_rank_computes_on_its_own_gpu_in_an_nccl_group(nproc):
    results = run_distributed(group_facts, nproc=nproc, backend=BACKEND, timeout=90)
    total = sum(rank + 1 for rank in range(nproc))  # what the ranks' (rank + 1) sum to
    for rank, facts in enumerate(results):
        assert facts["backend"] == BACKEND
        assert (facts["rank"], facts["world_size"]) == (rank, nproc)
        assert facts["local_rank"] == facts["env_local_rank"] == rank  # one machine
        assert facts["device"] == f"{DEVICE_TYPE}:{rank}"
        assert facts["current_device"] == rank  # set before the rank's function ran
        assert facts["model_device"] == facts["device"] == facts["direct_device"]
        assert facts["direct_all_reduce"] == [float(total)] * 3
        assert facts["all_reduce_sum"] == [[float(total)], [float(nproc)] * 2]
        assert facts["any"] is True
        assert facts["all"] is (nproc == 1)
        assert facts["broadcast"] == 10  # rank 0's
