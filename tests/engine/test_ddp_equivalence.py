"""DDP through create_trainer: 2 ranks x batch B train exactly like 1 process x batch 2B."""

from __future__ import annotations

import math

import pytest
import torch
from _training import (
    flat_grads,
    flat_params,
    make_mlp,
    manual_window_grad,
    regression_rows,
    shard_batches,
    window_of,
)
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from unison.distributed import get_rank, get_world_size, prepare_model, unwrap_model
from unison.engine import Events, create_trainer
from unison.testing import run_distributed

PER_RANK = 4  # B
EPOCH_LENGTH = 5  # not a multiple of k=2: the last window of each epoch is shorter
MAX_EPOCHS = 2
CONFIGS = [("sgd", 1), ("sgd", 2), ("adam", 1), ("adam", 2)]
ACCUMULATION = [2, 3]


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(optimizer_name: str, k: int, rank: int, world_size: int) -> dict:
    """Trains from the same initial weights on this rank's half (or, alone, all) of each global batch."""
    x, y = regression_rows(EPOCH_LENGTH * PER_RANK * 2, seed=1)
    batches = shard_batches(
        x, y, n_batches=EPOCH_LENGTH, per_rank=PER_RANK * 2 // world_size, rank=rank, world_size=world_size
    )
    model = prepare_model(make_mlp(seed=0))
    assert isinstance(model, DistributedDataParallel) == (world_size > 1)
    optimizer = _optimizer(optimizer_name, model)
    trainer = create_trainer(model, optimizer, F.mse_loss, accumulation_steps=k)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(trainer.state.iteration))
    epoch_losses = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: epoch_losses.append(e.state.metrics["loss"]))
    trainer.run(batches, max_epochs=MAX_EPOCHS)
    return {
        "initial": flat_params(make_mlp(seed=0)),
        "params": flat_params(unwrap_model(model)),
        "steps": steps,
        "epoch_losses": epoch_losses,
    }


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("config", CONFIGS, ids=[f"{o}-k{k}" for o, k in CONFIGS])
def test_two_ranks_match_one_process_with_twice_the_batch(ddp_results, config):
    reference = _train(*config, rank=0, world_size=1)
    ranks = [r["equivalence"][config] for r in ddp_results]
    assert not torch.allclose(reference["params"], reference["initial"], atol=1e-3), "training did not move"
    expected_steps = [
        epoch * EPOCH_LENGTH + min(j * config[1], EPOCH_LENGTH)
        for epoch in range(MAX_EPOCHS)
        for j in range(1, math.ceil(EPOCH_LENGTH / config[1]) + 1)
    ]
    assert reference["steps"] == expected_steps
    for rank, result in enumerate(ranks):
        assert result["steps"] == expected_steps, f"rank {rank}"
        torch.testing.assert_close(
            result["params"], reference["params"], rtol=0, atol=1e-6, msg=f"rank {rank}"
        )
        # The epoch's loss: mean over ranks and iterations of half-batch losses == mean of full-batch losses.
        assert result["epoch_losses"] == pytest.approx(reference["epoch_losses"], rel=1e-5)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def accumulation_epoch_end_worker(k: int) -> dict:
    """Each rank trains on its own data; at every update, records grads, params and the local grads."""
    rank = get_rank()
    x, y = regression_rows(EPOCH_LENGTH * PER_RANK, seed=100 + rank)  # different data on each rank
    batches = shard_batches(x, y, n_batches=EPOCH_LENGTH, per_rank=PER_RANK, rank=0, world_size=1)
    model = prepare_model(make_mlp(seed=rank))  # DDP broadcasts rank 0's weights
    module = unwrap_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, F.mse_loss, accumulation_steps=k)
    updates = []

    def before_step(opt, args, kwargs):
        it = trainer.state.iteration
        window = [batches[p] for p in window_of(it, EPOCH_LENGTH, k)]
        updates.append(
            {
                "iteration": it,
                "window": len(window),
                "grads": flat_grads(module),
                # What this rank's gradient would be without the all-reduce.
                "local": manual_window_grad(module, window, F.mse_loss),
            }
        )

    def after_step(opt, args, kwargs):
        updates[-1]["params"] = flat_params(module)

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    trainer.run(batches, max_epochs=MAX_EPOCHS)
    return {"updates": updates, "final": flat_params(module)}


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("k", ACCUMULATION)
def test_accumulation_synchronises_the_short_last_window(ddp_results, k):
    results = [r["accumulation"][k] for r in ddp_results]
    per_epoch = math.ceil(EPOCH_LENGTH / k)
    r0, r1 = (r["updates"] for r in results)
    assert len(r0) == len(r1) == per_epoch * MAX_EPOCHS
    last_window = EPOCH_LENGTH - (per_epoch - 1) * k
    assert [u["window"] for u in r0] == ([k] * (per_epoch - 1) + [last_window]) * MAX_EPOCHS
    for a, b in zip(r0, r1, strict=True):
        it = a["iteration"]
        assert it == b["iteration"]
        # The ranks' own gradients differ (different data), so only the all-reduce makes them agree.
        assert not torch.allclose(a["local"], b["local"], atol=1e-4), f"iteration {it}: data too similar"
        torch.testing.assert_close(a["grads"], b["grads"], rtol=0, atol=1e-7, msg=f"grads at iteration {it}")
        torch.testing.assert_close(
            a["grads"], (a["local"] + b["local"]) / 2, rtol=1e-5, atol=1e-6, msg=f"mean at iteration {it}"
        )
        assert torch.equal(a["params"], b["params"]), (
            f"parameters diverged after the update at iteration {it}"
        )
    assert torch.equal(results[0]["final"], results[1]["final"])


def ddp_worker() -> dict:
    """Everything this module checks, in one 2-rank job (DDP's first construction in a process costs
    seconds: it imports torch._dynamo)."""
    rank, world_size = get_rank(), get_world_size()
    return {
        "equivalence": {cfg: _train(*cfg, rank=rank, world_size=world_size) for cfg in CONFIGS},
        "accumulation": {k: accumulation_epoch_end_worker(k) for k in ACCUMULATION},
    }


@pytest.fixture(scope="module")
def ddp_results() -> list[dict]:
    return run_distributed(ddp_worker, nproc=2, timeout=80)
