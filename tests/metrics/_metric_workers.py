"""Rank functions and shared fixtures of tests/metrics/test_exact_evaluation.py.

Kept apart from the test module so that spawned ranks import this small module by name
instead of the test module (which would import pytest in every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _collective_probe import count_collectives
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from unison.distributed import get_rank, prepare_loaders
from unison.engine import create_evaluator
from unison.metrics import Accuracy, Loss, MeanAbsoluteError, MeanSquaredError

SIZES = (101, 7, 2)
N_FEATURES, N_CLASSES, N_TARGETS = 5, 4, 2
BATCH_SIZE = 4


# --- the data and models, built identically on every rank and in this process ---------------------


def dataset(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + n)
    return {
        "x": torch.randn(n, N_FEATURES, generator=gen, dtype=torch.float64),
        "label": torch.randint(0, N_CLASSES, (n,), generator=gen),
        "target": torch.randn(n, N_TARGETS, generator=gen, dtype=torch.float64),
    }


def linear(out_features: int, seed: int) -> nn.Linear:
    """A float64 linear model whose weights come from ``seed`` alone, not the global RNG."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(N_FEATURES, out_features).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(model.weight.shape, generator=gen, dtype=torch.float64))
        model.bias.copy_(torch.randn(model.bias.shape, generator=gen, dtype=torch.float64))
    return model


def classifier() -> nn.Linear:
    return linear(N_CLASSES, seed=7)


def regressor() -> nn.Linear:
    return linear(N_TARGETS, seed=8)


def classification_metrics() -> dict:
    return {
        "acc": Accuracy(),
        "top2": Accuracy(top_k=2),
        "loss": Loss(F.cross_entropy),
        "nll": Loss(lambda y_pred, y: F.nll_loss(F.log_softmax(y_pred, dim=1), y)),
    }


def regression_metrics() -> dict:
    return {"mse": MeanSquaredError(), "mae": MeanAbsoluteError(), "loss": Loss(F.mse_loss)}


def reference(n: int) -> dict[str, dict[str, float]]:
    """The metrics of the whole dataset, computed in one process directly with torch."""
    data = dataset(n)
    with torch.no_grad():
        logits = classifier()(data["x"])
        prediction = regressor()(data["x"])
    label = data["label"]
    target_score = logits.gather(1, label.unsqueeze(1))
    classes_above_target = (logits > target_score).sum(dim=1)
    error = prediction - data["target"]
    return {
        "cls": {
            "acc": (logits.argmax(dim=1) == label).sum().item() / n,
            "top2": (classes_above_target < 2).sum().item() / n,
            "loss": F.cross_entropy(logits, label).item(),
            "nll": -torch.log_softmax(logits, dim=1).gather(1, label.unsqueeze(1)).mean().item(),
        },
        "reg": {
            "mse": error.square().mean().item(),
            "mae": error.abs().mean().item(),
            "loss": error.square().mean().item(),
        },
    }


# --- rank functions ------------------------------------------------------------------------------------


def evaluate_every_size(sizes: tuple[int, ...]) -> dict:
    # Each rank's global RNG differs: nothing below may depend on it.
    torch.manual_seed(12345 + get_rank())
    out = {}
    for n in sizes:
        data = dataset(n)
        _, cls_loader = prepare_loaders(val=TensorDataset(data["x"], data["label"]), batch_size=BATCH_SIZE)
        _, reg_loader = prepare_loaders(val=TensorDataset(data["x"], data["target"]), batch_size=BATCH_SIZE)
        cls_eval = create_evaluator(classifier(), classification_metrics())
        reg_eval = create_evaluator(regressor(), regression_metrics())
        out[n] = {
            "cls": dict(cls_eval.run(cls_loader).metrics),
            "reg": dict(reg_eval.run(reg_loader).metrics),
            "indices": list(cls_loader.sampler),
            "batches": len(cls_loader),
        }
    return out


def padded_sampler_accuracy(scores: list[list[float]], labels: list[int]) -> dict:
    from ignite.metrics import Accuracy as IgniteAccuracy

    ds = TensorDataset(torch.tensor(scores), torch.tensor(labels))
    padded = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=False))
    _, exact = prepare_loaders(val=ds, batch_size=2)
    ignite_padded = create_evaluator(nn.Identity(), {"acc": IgniteAccuracy()}).run(padded).metrics["acc"]
    unison_exact = create_evaluator(nn.Identity(), {"acc": Accuracy()}).run(exact).metrics["acc"]
    return {"ignite_padded": ignite_padded, "unison_exact": unison_exact}


def count_evaluation_collectives(sizes: tuple[int, ...], with_ignite: bool) -> dict:
    from ignite.metrics import Accuracy as IgniteAccuracy
    from ignite.metrics import Loss as IgniteLoss
    from ignite.metrics import MeanSquaredError as IgniteMSE
    from ignite.metrics import TopKCategoricalAccuracy

    def probabilities_vs_one_hot(output):
        y_pred, y = output
        return torch.softmax(y_pred, dim=1), F.one_hot(y, N_CLASSES).to(y_pred.dtype)

    out: dict = {}
    for n in sizes:
        data = dataset(n)
        _, loader = prepare_loaders(val=TensorDataset(data["x"], data["label"]), batch_size=BATCH_SIZE)
        ours = {
            "acc": Accuracy(),
            "top2": Accuracy(top_k=2),
            "loss": Loss(F.cross_entropy),
            "brier": MeanSquaredError(output_transform=probabilities_vs_one_hot),
        }
        evaluator = create_evaluator(classifier(), ours)
        with count_collectives() as calls:
            metrics = evaluator.run(loader).metrics
        out[("unison", n)] = {"calls": dict(calls), "metrics": dict(metrics), "local": len(loader.sampler)}
        if with_ignite:
            theirs = {
                "acc": IgniteAccuracy(),
                "top2": TopKCategoricalAccuracy(k=2),
                "loss": IgniteLoss(F.cross_entropy),
                "brier": IgniteMSE(output_transform=probabilities_vs_one_hot),
            }
            evaluator = create_evaluator(classifier(), theirs)
            with count_collectives() as calls:
                metrics = evaluator.run(loader).metrics
            out[("ignite", n)] = {
                "calls": dict(calls),
                "metrics": dict(metrics),
                "local": len(loader.sampler),
            }
    return out
