"""unison/distributed/fsdp.py: a model with tied weights (an output projection that is the
embedding) trains under FSDP2 as under DDP, and resumes from its sharded checkpoint.

FSDP2 shards a parameter in one unit only: tied parameters are left to the unit that holds
every module using them (here the root), however the shard rule chose the units.
"""

from __future__ import annotations

import pytest
import torch
from _fsdp_tied_workers import TiedLM, job
from torch import nn

from unison.distributed.units import auto_units
from unison.testing import run_distributed

EPOCHS = 2  # 8 iterations at 2 ranks


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_units_that_share_a_parameter_with_another_unit_or_the_root_are_left_to_the_root():
    from unison.distributed.units import untied_units

    lm = TiedLM()
    units = auto_units(lm)  # the blocks, and the head and decoder (Linears outside them)
    assert units == [lm.blocks[0], lm.blocks[1], lm.head, lm.decoder]
    kept, tied = untied_units(lm, units)
    assert kept == [lm.blocks[0], lm.blocks[1], lm.head]
    assert tied == {"encoder.weight": ["decoder.weight"]}
    shared = nn.Linear(4, 4)
    twins = nn.Sequential(nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Tanh()), nn.Linear(4, 2))
    assert untied_units(twins, [twins[0], twins[1], twins[2]]) == (
        [twins[2]],
        {"0.0.weight": ["1.0.weight"], "0.0.bias": ["1.0.bias"]},
    )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_trains_a_tied_model_as_ddp_and_resumes_it(tmp_path):
    ddp = run_distributed(job, str(tmp_path / "ddp"), "ddp", EPOCHS, nproc=2, timeout=100)
    fsdp = run_distributed(job, str(tmp_path / "fsdp"), "fsdp", EPOCHS, nproc=2, timeout=100)
    for rank in range(2):
        (d, d_tied, d_its), (f, f_tied, f_its) = ddp[rank], fsdp[rank]
        assert d_its == f_its == 8 and d_tied and f_tied
        assert _gap(f, d) < 1e-5, rank
        assert torch.equal(f["decoder.weight"], f["encoder.weight"])
    folder = str(tmp_path / "resumed")
    run_distributed(job, folder, "fsdp", EPOCHS, stop_after=3, nproc=2, timeout=100)
    resumed = run_distributed(job, folder, "fsdp", EPOCHS, resume=True, nproc=2, timeout=100)
    for rank in range(2):
        weights, tied, iterations = resumed[rank]
        assert iterations == 8 and tied
        assert _gap(weights, fsdp[rank][0]) < 1e-6, rank
