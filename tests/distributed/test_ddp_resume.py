"""A run stopped at iteration k and resumed from its state_dicts ends bitwise equal to the
uninterrupted run, at 1, 2 and 3 ranks (the uninterrupted run is the truth, DESIGN rule 9).

Stock DDP breaks it at 3 ranks: its Reducer re-lays the gradient buckets after the first
backward, and gloo's ring all-reduce sums an element in an order that depends on its
position in the bucket; ``prepare_model`` lays the buckets out once, at wrapping
(``unison/distributed/ddp_buckets.py``). The rank functions are in ``_ddp_workers.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ddp_workers import (
    final_params,
    from_bytes,
    layouts_of_both,
    load_and_finish,
    resume_gaps,
    train_and_save,
    wrapper_types,
)
from torch.nn.parallel import DistributedDataParallel

from unison.distributed.ddp_buckets import FixedBucketsDDP
from unison.testing import run_distributed

TOTAL = 6
STOPS = [1, 2, 3]
SMALL = (8, 16, 16, 3)  # one bucket
WIDE = (784, 512, 512, 10)  # two buckets after DDP's rebuild: 1 MiB first-bucket cap, then 25 MiB


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_resumed_run_is_bitwise_the_uninterrupted_run(nproc):
    for rank, gaps in enumerate(
        run_distributed(resume_gaps, TOTAL, STOPS, "unison", nproc=nproc, timeout=45)
    ):
        assert gaps == {stop: 0.0 for stop in STOPS}, f"rank {rank}: max |resumed - uninterrupted| {gaps}"


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ddp_kwargs", [{"static_graph": True}, {"gradient_as_bucket_view": True}])
def test_resume_is_exact_with_other_ddp_settings(ddp_kwargs):
    (gaps, *_) = run_distributed(resume_gaps, TOTAL, [2], "unison", nproc=3, timeout=45, **ddp_kwargs)
    assert gaps == {2: 0.0}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_stock_ddp_resume_differs_at_3_ranks():
    """The reason for FixedBucketsDDP. If this fails, torch stopped re-laying the buckets
    (or gloo's summation order stopped depending on the layout): the workaround in
    ``ddp_buckets.py`` may no longer be needed."""
    for gaps in run_distributed(resume_gaps, TOTAL, STOPS, "torch", nproc=3, timeout=45):
        assert all(0.0 < gap < 1e-6 for gap in gaps.values()), gaps


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_resume_across_fresh_process_groups(tmp_path):
    path = str(tmp_path / "state.pt")
    truth = run_distributed(train_and_save, TOTAL, 2, "unison", path, nproc=3, timeout=45)
    resumed = run_distributed(load_and_finish, TOTAL, 2, "unison", path, nproc=3, timeout=45)
    for rank in range(3):
        assert torch.equal(from_bytes(resumed[rank]), from_bytes(truth[rank])), f"rank {rank}"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_results_at_2_ranks_equal_stock_ddp():
    """With two ranks a + b == b + a: the new layout changes no bit of the results."""
    for rank, params in enumerate(
        run_distributed(final_params, TOTAL, ["torch", "unison"], nproc=2, timeout=45)
    ):
        assert params["torch"] == params["unison"], f"rank {rank}"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_fresh_layout_is_stock_ddps_rebuilt_layout_and_never_changes():
    """The invariant the fix relies on, and the private torch behaviour it pins: a fresh
    ``prepare_model`` wrap already has the layout stock DDP rebuilds to after its first
    backward (reverse definition order, 1 MiB / 25 MiB caps), and keeps it."""
    (result, *_) = run_distributed(layouts_of_both, [SMALL, WIDE], nproc=2, timeout=45)
    for widths, expected in ((SMALL, [[5, 4, 3, 2, 1, 0]]), (WIDE, [[5, 4, 3, 2], [1, 0]])):
        stock, fixed = result[widths]["torch"], result[widths]["unison"]
        assert stock["type"] == "DistributedDataParallel" and fixed["type"] == "FixedBucketsDDP"
        # stock DDP: one bucket in definition order, re-laid in the forward after the first backward
        assert stock["layouts"] == [[[0, 1, 2, 3, 4, 5]], [[0, 1, 2, 3, 4, 5]], expected, expected]
        # prepare_model: the rebuilt layout from the start, and DDP's rebuild already done
        assert fixed["layouts"] == [expected] * 4
        assert fixed["has_rebuilt"] is True
        assert fixed["logging"]["rebuilt_bucket_sizes"] == stock["logging"]["rebuilt_bucket_sizes"]


def test_private_torch_apis_exist():
    """What ddp_buckets.py calls; the distributed tests above pin what they do."""
    assert callable(DistributedDataParallel._build_params_for_reducer)
    for name in ("_push_all_rebuilt_params", "_rebuild_buckets", "_get_zeros_like_grad_buckets"):
        assert callable(getattr(dist.Reducer, name, None)), f"torch.distributed.Reducer.{name} is gone"


def test_fixed_buckets_refuse_find_unused_parameters():
    """With find_unused_parameters=True DDP never re-lays its buckets, so it is exact as it is."""
    with pytest.raises(ValueError, match="never rebuilds"):
        FixedBucketsDDP(torch.nn.Linear(2, 2), find_unused_parameters=True)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_prepare_model_picks_the_wrapper():
    (types, *_) = run_distributed(wrapper_types, nproc=2, timeout=45)
    assert types == {
        "default": "FixedBucketsDDP",
        "find_unused_parameters": "DistributedDataParallel",
        "find_unused_parameters+static_graph": "FixedBucketsDDP",
        "unwrap_model": "Sequential",
    }
