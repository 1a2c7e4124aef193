"""The charlm and diabetes recipes train a few iterations from the Python API."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from unison.recipe.phases import run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "diabetes"))
import diabetes  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_charlm_reports_perplexity_and_samples_text(tmp_path: Path) -> None:
    results = run(
        ROOT / "recipes" / "charlm" / "config.yaml",
        overrides=[
            "training.max_epochs=1",
            "training.epoch_length=4",
            "training.batch_size=8",
            "data.kwargs.limit=20000",
            "model.kwargs.dim=32",
            "model.kwargs.layers=1",
            "logging.progress=false",
            f"logging.root={tmp_path}",
        ],
    )
    run_dir = Path(results["run_dir"])
    assert results["iterations"] == 4
    perplexity = results["validation"]["perplexity"]
    # Perplexity is exp of the mean token loss, and a barely trained model is near-uniform.
    assert perplexity == pytest.approx(math.exp(results["validation"]["loss"]), rel=1e-9)
    assert 1.0 < perplexity < 1000.0
    samples = (run_dir / "samples.txt").read_text()
    assert samples.startswith("The ") and len(samples) > 3 * 160
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["validation_perplexity"] == pytest.approx(perplexity)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_diabetes_regression_learns_and_tests_the_best_checkpoint(tmp_path: Path) -> None:
    results = run(
        ROOT / "recipes" / "diabetes" / "config.yaml",
        overrides=[
            "training.max_epochs=8",
            "logging.progress=false",
            "predict.enabled=true",
            f"logging.root={tmp_path}",
        ],
    )
    history = results["history"]
    assert len(history) == 8
    # Targets are standardised: predicting the mean gives an MSE near 1; training beats it.
    assert history[-1]["val_mse"] < history[0]["val_mse"]
    assert history[-1]["val_mse"] < 1.0
    assert set(results["test"]) == {"mse", "mae"}
    manifest = json.loads((Path(results["run_dir"]) / "checkpoints" / "manifest.json").read_text())
    best = min(manifest["checkpoints"], key=lambda e: e["score"])
    assert best["score"] == pytest.approx(min(row["val_mse"] for row in history))
    # predict.enabled: one prediction per test sample, in dataset order, on rank 0.
    predictions = torch.load(results["predictions"], weights_only=True)
    assert predictions.shape == (len(diabetes.build_datasets(seed=0)[2]), 1)
