"""Evaluation and predict use the buffers rank 0 saves (BatchNorm's running statistics)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from unison.distributed import EvalSampler, TrainSampler, get_rank, prepare_model, unwrap_model
from unison.engine import create_evaluator, create_trainer
from unison.engine.predict import predict
from unison.metrics import Loss, MeanSquaredError
from unison.testing import run_distributed


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g) * 3 + 1, torch.randn(n, 1, generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def _metrics() -> dict:
    return {"mse": MeanSquaredError(), "loss": Loss(torch.nn.functional.mse_loss)}


def _train_then_evaluate() -> dict:
    model = prepare_model(_model())
    train = _data(24, 1)
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), torch.nn.functional.mse_loss
    )
    trainer.run(DataLoader(train, batch_size=4, sampler=TrainSampler(train, seed=0)), max_epochs=2)
    val = _data(11, 2)
    evaluator = create_evaluator(model, _metrics())
    metrics = evaluator.run(DataLoader(val, batch_size=4, sampler=EvalSampler(val))).metrics
    return {
        "rank": get_rank(),
        "metrics": dict(metrics),
        "saved": {k: v.clone() for k, v in unwrap_model(model).state_dict().items()},
        "predicted": predict(model, val, batch_size=4),
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_rank_evaluates_the_model_rank_0_saves() -> None:
    ranks = run_distributed(_train_then_evaluate, nproc=2, timeout=100)
    zero = ranks[0]
    model = _model()
    model.load_state_dict(zero["saved"])  # what a checkpoint of rank 0 holds
    val = _data(11, 2)
    alone = create_evaluator(model, _metrics()).run(DataLoader(val, batch_size=4)).metrics
    for rank in ranks:
        assert rank["metrics"] == pytest.approx(dict(alone), rel=1e-6)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(zero["predicted"], model(val.tensors[0]), atol=1e-6)
    assert ranks[1]["predicted"] is None


def _evaluate_with(sampler_kind: str) -> list[str]:
    import logging

    from _log_capture import LogRecords
    from torch.utils.data import DistributedSampler

    logging.getLogger("unison").setLevel(logging.INFO)
    data = _data(5, 3)  # 5 samples on 2 ranks: a DistributedSampler pads one
    sampler = DistributedSampler(data, shuffle=False) if sampler_kind == "torch" else EvalSampler(data)
    evaluator = create_evaluator(torch.nn.Linear(3, 1), _metrics())
    with LogRecords() as logs:
        evaluator.run(DataLoader(data, batch_size=2, sampler=sampler))
        evaluator.run(DataLoader(data, batch_size=2, sampler=sampler))
    return [m for m in logs.messages if "pads" in m]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_evaluation_on_a_padding_sampler_is_warned_once_naming_the_fix() -> None:
    warned = run_distributed(_evaluate_with, "torch", nproc=2, timeout=100)
    assert all(len(w) == 1 and "pads 1 of 5 samples" in w[0] and "EvalSampler" in w[0] for w in warned)
    assert run_distributed(_evaluate_with, "unison", nproc=2, timeout=100) == [[], []]
