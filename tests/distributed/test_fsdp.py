"""FSDP2 trains to DDP's parameters, and evaluates and predicts exactly on uneven shards.

DDP at the same world size is the truth: both see the same batches on each rank and
reduce the same gradients, FSDP2 by reduce-scatter over shards, DDP by all-reduce, so
the results agree to float tolerance (summation order differs), at 1, 2 and 3 ranks.
"""

from __future__ import annotations

import pytest
import torch
from _fsdp_workers import ema_evaluated, evaluate_uneven, train

from unison.testing import run_distributed

ITERATIONS = 6


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_fsdp_trains_to_the_ddp_parameters(nproc):
    kwargs = {"accumulation_steps": 2, "clip_grad_norm": 0.5}
    ddp = run_distributed(train, "ddp", ITERATIONS, nproc=nproc, timeout=90, **kwargs)
    fsdp = run_distributed(train, "fsdp", ITERATIONS, nproc=nproc, timeout=90, **kwargs)
    for rank in range(nproc):
        assert _close(fsdp[rank], ddp[rank]) < 1e-5, f"rank {rank}"
        assert _close(fsdp[rank], fsdp[0]) == 0.0  # every rank holds the same model
    if nproc == 1:
        return
    # the gradients were reduced: a run without sync on inner steps differs from one rank's own
    alone = run_distributed(train, "ddp", ITERATIONS, nproc=1, timeout=90, **kwargs)[0]
    assert _close(fsdp[0], alone) > 1e-4


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fsdp_with_bf16_autocast_matches_ddp():
    ddp = run_distributed(train, "ddp", 4, nproc=2, timeout=90, amp="bf16")
    fsdp = run_distributed(train, "fsdp", 4, nproc=2, timeout=90, amp="bf16")
    assert _close(fsdp[0], ddp[0]) < 1e-3


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2, 3])
def test_fsdp_evaluates_and_predicts_exactly_on_uneven_shards(nproc):
    samples = 7  # 3 ranks: shards of 3, 2, 2 rows, in 2, 1, 1 batches
    (truth_metrics, truth_rows), *_ = run_distributed(evaluate_uneven, "ddp", samples, nproc=1, timeout=60)
    results = run_distributed(evaluate_uneven, "fsdp", samples, nproc=nproc, timeout=90)
    metrics, rows = results[0]
    assert metrics["acc"] == truth_metrics["acc"]
    assert metrics["loss"] == pytest.approx(truth_metrics["loss"], rel=1e-6)
    assert rows is not None and torch.allclose(rows, truth_rows, atol=1e-6)
    assert all(r[1] is None for r in results[1:])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_ema_of_a_sharded_model_is_what_the_evaluator_runs():
    for loss, average, trained, moved in run_distributed(ema_evaluated, "fsdp", 4, nproc=2, timeout=90):
        assert loss == pytest.approx(average, rel=1e-6)  # the average, swapped into the shards
        assert abs(average - trained) > 1e-4  # (which the trained weights would not give)
        assert moved == 0.0  # and the trained weights are back afterwards


def test_the_auto_rule_shards_the_repeated_blocks_outermost_first():
    from torch import nn

    from unison.distributed.units import auto_units, named_units

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    model = nn.Sequential(nn.Linear(2, 4), Block(), Block(), nn.LayerNorm(4), nn.Linear(4, 1))
    units = auto_units(model)
    # the blocks (not their Linears, inside a unit already), and the Linears outside them
    assert [type(u).__name__ for u in units] == ["Linear", "Block", "Block", "Linear"]
    assert named_units(model, ["Block"]) == [model[1], model[2]]
    with pytest.raises(ValueError, match=r"\['Bogus'\].*Block"):
        named_units(model, ["Bogus"])


def test_a_container_without_a_forward_is_never_a_unit():
    """``nn.Transformer`` holds two ``ModuleList``s of layers: the auto rule took ModuleList for a
    block class (two instances holding parameters) and ``fully_shard`` refused it. The layers inside
    are the units now; naming the container fails, naming them."""
    from torch import nn

    from unison.distributed.units import auto_units, named_units

    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16)
    units = auto_units(model)
    assert [type(u).__name__ for u in units] == [
        "TransformerEncoderLayer",
        "TransformerEncoderLayer",
        "LayerNorm",
        "TransformerDecoderLayer",
        "TransformerDecoderLayer",
        "LayerNorm",
    ]
    assert units[0] is model.encoder.layers[0] and units[4] is model.decoder.layers[1]
    with pytest.raises(
        ValueError, match=r"\['ModuleList'\], which only hold modules.*TransformerEncoderLayer"
    ):
        named_units(model, ["ModuleList", "LayerNorm"])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_model_of_two_module_lists_trains_sharded_as_under_ddp():
    """Two ``ModuleList``s of layers (a graph network's convolutions and norms, a transformer's
    encoder and decoder): sharded with the auto rule, two steps leave the weights DDP's leave."""
    from _fsdp_workers import two_lists_trained

    (ddp, _), (ddp_other, _) = run_distributed(two_lists_trained, "ddp", nproc=2, timeout=90)
    (fsdp, units), (fsdp_other, _) = run_distributed(two_lists_trained, "fsdp", nproc=2, timeout=90)
    assert units == ["FSDPLinear"] * 6  # every layer of both lists, none of the lists
    assert ddp.keys() == fsdp.keys()
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=1e-5, atol=1e-6)
        assert torch.equal(fsdp[name], fsdp_other[name]) and torch.equal(ddp[name], ddp_other[name])


def test_a_shard_rule_naming_no_class_of_the_model_fails_before_spawning(tmp_path):
    from pathlib import Path

    from unison.config import ConfigError
    from unison.recipe.phases import run

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "digits" / "config.yaml"
    overrides = ["parallel.strategy=fsdp", "parallel.fsdp.shard=[Bogus]", f"logging.root={tmp_path}"]
    with pytest.raises(ConfigError, match=r"parallel\.fsdp\.shard.*\['Bogus'\]"):
        run(str(recipe), nproc=2, overrides=overrides)
