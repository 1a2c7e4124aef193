"""unison/distributed/activation_ckpt.py: the recomputation in backward updates no buffer, so a
model with BatchNorm inside its checkpointed blocks trains and evaluates as without.

Bitwise, not allclose: the recomputation runs the same kernels on the same inputs (dropout's
mask restored), so every weight, gradient and running statistic is the same float.
"""

from __future__ import annotations

import pytest
import torch
from _activation_ckpt_bn_workers import both

from unison.testing import run_distributed

ITERATIONS = 5


def test_a_backward_that_retains_the_graph_recomputes_on_copies_again():
    from _activation_ckpt_bn_workers import NormNet, batch

    from unison.distributed import prepare_model

    model = prepare_model(NormNet(0.0), activation_checkpointing="auto")
    x, _ = batch(0, 0)
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()  # a second recomputation, in the same context
    assert int(model.blocks[0].norm.num_batches_tracked) == 1


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), (key, a[key], b[key])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_batchnorm_in_a_checkpointed_block_counts_each_step_once_in_one_process(dropout: float):
    out = both(ITERATIONS, dropout)
    plain, ac = out["plain"], out["ac"]
    assert int(ac["state"]["blocks.0.norm.num_batches_tracked"]) == ITERATIONS
    _equal(plain["state"], ac["state"])  # weights, running_mean, running_var, num_batches_tracked
    assert (plain["accuracy"], plain["loss"]) == (ac["accuracy"], ac["loss"])


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("strategy", "dropout"), [("ddp", 0.0), ("ddp", 0.3), ("fsdp", 0.3)])
def test_batchnorm_in_a_checkpointed_block_trains_and_evaluates_as_without_at_two_ranks(
    strategy: str, dropout: float
):
    for rank, out in enumerate(run_distributed(both, ITERATIONS, dropout, strategy, nproc=2, timeout=100)):
        plain, ac = out["plain"], out["ac"]
        assert int(ac["state"]["blocks.1.norm.num_batches_tracked"]) == ITERATIONS, rank
        _equal(plain["state"], ac["state"])
        assert (plain["accuracy"], plain["loss"]) == (ac["accuracy"], ac["loss"]), rank
