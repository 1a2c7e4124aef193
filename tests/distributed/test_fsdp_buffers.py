"""Under FSDP2 the model's buffers are rank 0's: resumed, saved, validated, tested and exported alike.

Each rank's BatchNorm statistics follow its own batches. The truths: the uninterrupted run
for a resumed one, bit for bit, parameters and buffers; and the buffers the validation ran
with (rank 0's average) for what the checkpoint holds, what the test phase loads and what
``unison export --ema`` writes.
"""

from __future__ import annotations

import pytest
import torch
from _fsdp_buffer_workers import job, phase_buffers

from unison.checkpoint import Manifest
from unison.checkpoint.consolidate import model_weights
from unison.testing import run_distributed

EPOCHS = 2


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    differ = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{what}: {differ}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_batchnorm_resumes_bitwise_and_exports_what_was_validated(tmp_path):
    truth = run_distributed(job, str(tmp_path / "a"), EPOCHS, nproc=2, timeout=120)
    # before any save, each rank's statistics are its own: the agreement below is not met by chance
    assert not torch.equal(
        truth[0]["before_saving"]["1.running_mean"], truth[1]["before_saving"]["1.running_mean"]
    )

    folder = tmp_path / "b"
    run_distributed(job, str(folder), EPOCHS, stop_after=5, nproc=2, timeout=120)  # mid-epoch 1 of 6 steps
    resumed = run_distributed(job, str(folder), EPOCHS, resume=True, nproc=2, timeout=120)
    for rank in (0, 1):
        assert resumed[rank]["iteration"] == truth[rank]["iteration"] == 2 * 6
        _equal(resumed[rank]["state"], truth[rank]["state"], f"model, rank {rank}")
        _equal(resumed[rank]["ema"], truth[rank]["ema"], f"average, rank {rank}")
        _equal(truth[rank]["state"], truth[0]["state"], f"rank {rank} after the last save")

    validated = truth[0]["validated"][-1]  # the last epoch's validation, on rank 0
    _equal(truth[1]["validated"][-1], validated, "validated on rank 1")
    _equal(resumed[0]["validated"][-1], validated, "validated after the resume")
    newest = Manifest(tmp_path / "a").rebuild().newest_complete()
    assert newest is not None and newest.suffix == ".dcp"
    exported = model_weights(newest, ema=True)
    _equal({k: exported[k] for k in validated}, validated, "exported with --ema")
    _equal(
        {k: v for k, v in exported.items() if k not in validated},
        _params(truth[0]["ema"], validated),
        "params",
    )
    for rank, seen in enumerate(run_distributed(phase_buffers, str(newest), nproc=2, timeout=120)):
        _equal(seen, validated, f"tested on rank {rank}")


def _params(weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if k not in buffers}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_agree_replicated_gives_every_plain_tensor_rank_0s_value_and_leaves_shards():
    from _fsdp_buffer_workers import agree_nested

    results = run_distributed(agree_nested, nproc=2, timeout=90)
    for rank, got in enumerate(results):
        assert got["count"] == 3  # the floats, the counter (once) and the flags; not the empty one
        assert torch.equal(got["mean"], torch.full((3,), 0.5))
        assert int(got["counter"]) == 10
        assert got["flag"].tolist() == [False, True]
        assert torch.equal(got["shard"], torch.full((2,), float(rank)))  # each rank's own shard
        assert got["lr"] == pytest.approx(0.1 * (rank + 1))  # not a tensor: not touched


def test_agree_replicated_is_nothing_in_one_process():
    from unison.distributed.replicated import agree_replicated

    state = {"mean": torch.ones(2)}
    assert agree_replicated(state) == 0
    assert torch.equal(state["mean"], torch.ones(2))
