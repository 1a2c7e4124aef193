"""Seeding: the same seed on every rank, then a stream of its own per rank for training."""

from __future__ import annotations

import pytest
import torch

from unison.distributed import TrainSampler, get_rank
from unison.engine import Events, create_trainer
from unison.testing import run_distributed
from unison.utils import manual_seed, rank_seed


def _dropout_run() -> dict:
    manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    weights = model[0].weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    masks: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, i, o: masks.append((o != 0).clone()))
    trainer = create_trainer(model, optimizer, torch.nn.functional.mse_loss)
    trainer.run([(torch.ones(8, 4), torch.zeros(8, 4))] * 2)
    sampler = TrainSampler(range(10), seed=3)
    sampler.set_epoch(1)
    return {"rank": get_rank(), "weights": weights, "masks": torch.stack(masks), "order": list(sampler)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_draw_their_own_dropout_but_share_weights_and_permutations() -> None:
    alone = _dropout_run()
    first, second = run_distributed(_dropout_run, nproc=2, timeout=100)
    assert torch.equal(first["weights"], second["weights"])  # built from the common seed
    assert not torch.equal(first["masks"], second["masks"])  # each rank its own stream
    assert torch.equal(first["masks"], alone["masks"])  # rank 0's stream is the one-process stream
    full = TrainSampler(range(10), seed=3, rank=0, world_size=1)
    full.set_epoch(1)
    assert sorted(first["order"] + second["order"]) == sorted(list(full))  # one permutation, sharded


def test_rank_seeds_are_distinct_and_rank_zero_keeps_the_seed() -> None:
    seeds = {rank_seed(s, r) for s in range(50) for r in range(1, 9)}
    assert len(seeds) == 50 * 8 and not seeds & set(range(50))
    assert rank_seed(12, 0) == 12


def test_a_resumed_run_does_not_fork_again() -> None:
    manual_seed(0)
    model = torch.nn.Linear(2, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    drawn: list[float] = []
    trainer.add_event_handler(Events.STARTED, lambda e: drawn.append(float(torch.rand(()))))
    trainer.run([(torch.ones(1, 2), torch.ones(1, 1))], max_epochs=1)
    state = trainer.state_dict()
    torch.manual_seed(5)
    expected = float(torch.rand(()))
    torch.manual_seed(5)
    trainer.load_state_dict(state)
    trainer.run([(torch.ones(1, 2), torch.ones(1, 1))], max_epochs=2)
    assert drawn[1] == expected  # the stream was left as it was found
