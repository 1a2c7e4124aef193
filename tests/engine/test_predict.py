"""predict: every sample once, sharded over the ranks, gathered on rank 0 in dataset order."""

from __future__ import annotations

import math

import pytest
import torch

from unison.engine.predict import predict
from unison.recipe.planning.resolved import scaled_lr
from unison.testing import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _data(n: int) -> torch.utils.data.TensorDataset:
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return torch.utils.data.TensorDataset(x, torch.zeros(n))


def _predict_worker(n: int, batch_size: int) -> torch.Tensor | None:
    return predict(_model(), _data(n), batch_size=batch_size)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("nproc", "n"), [(2, 7), (3, 7), (3, 2)])
def test_rank_zero_gets_every_prediction_in_dataset_order(nproc: int, n: int) -> None:
    results = run_distributed(_predict_worker, n, 2, nproc=nproc)
    expected = _model()(_data(n).tensors[0]).detach()
    assert torch.allclose(results[0], expected)
    assert all(r is None for r in results[1:])


def test_single_process_predicts_in_order_and_restores_the_mode() -> None:
    model = _model().train()
    out = predict(model, _data(5), batch_size=2)
    assert torch.allclose(out, model(_data(5).tensors[0]).detach())
    assert model.training


@pytest.mark.parametrize(
    ("rule", "world", "expected"),
    [
        ("none", 4, 0.1),
        ("linear", 4, 0.4),
        ("sqrt", 4, 0.2),
        ("linear", 1, 0.1),
        ("sqrt", 2, 0.1 * math.sqrt(2)),
    ],
)
def test_lr_scaling_rules(rule: str, world: int, expected: float) -> None:
    assert scaled_lr(0.1, rule, world) == pytest.approx(expected)
