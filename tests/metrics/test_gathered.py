"""ignite's epoch metrics through create_evaluator: exact on uneven, unpadded shards."""

from __future__ import annotations

import pytest
import torch
from ignite.metrics import EpochMetric
from torch.utils.data import DataLoader, TensorDataset

from unison.distributed import EvalSampler
from unison.engine import create_evaluator
from unison.metrics import exact_epoch_metric
from unison.testing import run_distributed

pytest.importorskip("sklearn")


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()
    y[:2] = torch.tensor([0, 1])  # both classes, whatever n
    return TensorDataset(x, y)


def _evaluate(n: int) -> dict[str, float]:
    from ignite.metrics import ROC_AUC, AveragePrecision

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Flatten(0))
    data = _data(n)
    loader = DataLoader(data, batch_size=2, sampler=EvalSampler(data))

    def probabilities(output):
        y_pred, y = output
        return torch.sigmoid(y_pred), y

    evaluator = create_evaluator(
        model,
        {
            "roc_auc": ROC_AUC(output_transform=probabilities),
            "average_precision": AveragePrecision(output_transform=probabilities),
        },
    )
    return dict(evaluator.run(loader).metrics)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("n", "nproc"), [(9, 2), (7, 3), (2, 3)])  # uneven shards; (2, 3): rank 2 has none
def test_epoch_metrics_equal_the_single_process_value(n: int, nproc: int) -> None:
    alone = _evaluate(n)
    results = run_distributed(_evaluate, n, nproc=nproc, timeout=120)
    assert all(r == pytest.approx(alone, abs=1e-12) for r in results)


def test_wrapping_is_idempotent_and_refuses_other_metrics() -> None:
    metric = EpochMetric(lambda p, t: 0.0, check_compute_fn=False)
    assert exact_epoch_metric(exact_epoch_metric(metric)) is metric
    with pytest.raises(TypeError, match="needs an ignite EpochMetric"):
        exact_epoch_metric(object())  # type: ignore[arg-type]  # the mistake under test
