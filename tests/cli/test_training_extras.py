"""training.ema, training.lr_scaling and DDP_FIND_UNUSED_PARAMETERS in runs built by the CLI's steps.

- EMA: validation, the best checkpoint, the test phase and predictions use the average
  (the truth: the average evaluated on its own, from the checkpoint that holds it).
- LR scaling: the learning rate each rank steps with, at 1, 2 and 3 ranks, for the same
  global batch (the truth: one process with the global batch), and the string form.
- find_unused_parameters: the config's value wins, else the environment variable.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch
from _cli_parts import config, parts_of, planned, resolved
from _lr_workers import ddp_find_unused, effective_lrs, sync_batchnorm_on_cpu

import unison.recipe.build.preflight
from unison.checkpoint import load_checkpoint
from unison.config import ConfigError, load_config
from unison.config.schema import EMAConfig, LRScalingConfig
from unison.distributed import find_unused_from_env
from unison.engine import create_evaluator
from unison.metrics import Accuracy, Loss
from unison.recipe.build.assemble import build_model, build_optimizer
from unison.recipe.phases import collect_results, finish_run
from unison.recipe.planning.run_plan import plan
from unison.testing import run_distributed

# -- EMA -----------------------------------------------------------------------------------------


def _trained(tmp_path: Path, evaluate: bool = True, epochs: int = 3):
    c = config(tmp_path)
    c.training.max_epochs = epochs
    c.training.ema = EMAConfig(decay=0.5, evaluate=evaluate)
    c.predict.enabled = True
    r = resolved()
    parts = parts_of(c, r, tmp_path)
    parts.trainer.run(parts.train_loader, max_epochs=epochs)
    results = collect_results(parts, tmp_path, 1)
    finish_run(planned(c, r), parts, tmp_path, results)
    return parts, results


def _evaluate(model: torch.nn.Module, dataset) -> dict[str, float]:
    evaluator = create_evaluator(
        model, {"accuracy": Accuracy(), "loss": Loss(torch.nn.functional.cross_entropy)}
    )
    return evaluator.run(torch.utils.data.DataLoader(dataset, batch_size=4)).metrics


def test_validation_test_and_predictions_use_the_average(tmp_path: Path) -> None:
    parts, results = _trained(tmp_path)
    ema = parts.ema
    assert ema is not None and ema.updates == 9  # 3 epochs x 3 updates
    assert parts.evaluator.process_function.model is ema.module
    final = _evaluate(ema.module, parts.datasets.val)
    assert results["validation"]["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert final["loss"] != pytest.approx(_evaluate(parts.model, parts.datasets.val)["loss"], rel=1e-6)

    best = parts.checkpoint.best
    assert best is not None
    objects = load_checkpoint(parts.checkpoint.folder / best.file)["objects"]
    assert "handler:EMA" in objects  # ranked on the average's validation accuracy (the watched metric)
    assert best.score == max(row["val_accuracy"] for row in results["history"])
    ema_of_best = torch.nn.Linear(4, 2)
    ema_of_best.load_state_dict(objects["handler:EMA"]["weights"])
    assert results["test"]["loss"] == pytest.approx(
        _evaluate(ema_of_best, parts.datasets.test)["loss"], rel=1e-6
    )

    predictions = torch.load(tmp_path / "predictions.pt", weights_only=True)
    x = torch.stack([parts.datasets.test[i][0] for i in range(len(parts.datasets.test))])
    with torch.no_grad():
        assert torch.equal(predictions, ema_of_best(x))


def test_evaluate_false_keeps_the_trained_model_and_still_saves_the_average(tmp_path: Path) -> None:
    parts, _ = _trained(tmp_path, evaluate=False, epochs=1)
    assert parts.ema is not None and parts.evaluator.process_function.model is parts.model
    latest = sorted(parts.checkpoint.folder.glob("*.pt"))[-1]
    assert load_checkpoint(latest)["objects"]["handler:EMA"]["updates"] == 3


def test_no_ema_section_attaches_none(tmp_path: Path) -> None:
    parts = parts_of(config(), resolved(), tmp_path)
    assert parts.ema is None and parts.evaluator.process_function.model is parts.model


# -- LR scaling ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("form", "accumulation", "world", "expected"),
    [
        ("linear", 3, 4, 0.5 * 4),  # the string form: x world size, accumulation or not (as before)
        ("sqrt", 1, 4, 0.5 * 2),
        (LRScalingConfig(rule="linear", reference_batch_size=8), 3, 2, 0.5 * (2 * 4 * 3) / 8),
        (LRScalingConfig(rule="sqrt", reference_batch_size=96), 3, 2, 0.5 * (24 / 96) ** 0.5),
        (LRScalingConfig(rule="linear"), 3, 2, 0.5 * 2),  # default reference: one rank's batch x accumulation
        (LRScalingConfig(rule="none", warmup_steps=4), 1, 8, 0.5),
    ],
)
def test_the_optimizer_gets_the_scaled_lr(form, accumulation: int, world: int, expected: float) -> None:
    c = config()
    c.training.lr = 0.5
    c.training.accumulation_steps = accumulation
    c.training.lr_scaling = form
    optimizer, _ = build_optimizer(planned(c), build_model(planned(c)), world)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def test_the_optimizers_default_lr_is_scaled_too() -> None:
    c = config()
    c.training.lr_scaling = "linear"
    r = resolved(optimizer_type=torch.optim.Adam, optimizer_kwargs={})
    optimizer, _ = build_optimizer(planned(c, r), build_model(planned(c, r)), 3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 3)


def test_one_line_says_the_learning_rate() -> None:
    c = config()
    c.training.lr_scaling = LRScalingConfig(rule="linear", reference_batch_size=4, warmup_steps=10)
    # A handler of our own on the logger that writes the line: counts what is logged, whatever
    # handlers earlier tests left on the loggers above it.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("unison.recipe.run")
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        build_optimizer(planned(c), build_model(planned(c)), 2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
    lines = [r.getMessage() for r in records if "learning rate" in r.getMessage()]
    assert lines == [
        "learning rate 0.2: lr 0.1, linear scaling by the global batch 8 (2 ranks x 4 x 1 accumulation) over 4; "
        "warmup over 10 optimizer updates, the first at 0.02"
    ]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_steps_with_the_lr_of_the_global_batch_at_1_2_and_3_ranks() -> None:
    """12 samples a step at every world size: the same learning rates and the same weights as one
    process with the global batch; the string form scales by the world size."""
    runs = {n: run_distributed(effective_lrs, 12 // n, nproc=n, timeout=200) for n in (2, 3)}
    runs[1] = [effective_lrs(12)]
    warm = [0.2 * min(1.0, k / 3) for k in range(1, 6)]
    for n, ranks in runs.items():
        assert len(ranks) == n
        for rank in ranks:
            assert rank["mapping"] == pytest.approx(warm, rel=1e-12)
            assert rank["mapping"] == runs[1][0]["mapping"]
            assert rank["string"] == pytest.approx([0.1 * n] * 5, rel=1e-12)
            torch.testing.assert_close(
                rank["mapping_weights"], runs[1][0]["mapping_weights"], rtol=0, atol=1e-6
            )


# -- DDP_FIND_UNUSED_PARAMETERS ------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_config_wins_over_the_environment_variable() -> None:
    seen = run_distributed(ddp_find_unused, nproc=2, timeout=100)
    refused = run_distributed(sync_batchnorm_on_cpu, nproc=2, timeout=100)
    assert all(
        "SyncBatchNorm runs on CUDA devices only" in r and "parallel.sync_batchnorm" in r for r in refused
    )
    assert (
        seen[0]
        == seen[1]
        == {
            "env=None config=None": False,
            "env=true config=None": True,
            "env=1 config=False": False,
            "env=no config=True": True,
        }
    )


@pytest.mark.parametrize(
    ("value", "expected"), [("TRUE", True), ("yes", True), ("0", False), (" off ", False)]
)
def test_the_variable_reads_as_a_bool(value: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDP_FIND_UNUSED_PARAMETERS", value)
    assert find_unused_from_env() is expected


def _config_file(tmp_path: Path, body: str) -> Path:
    (tmp_path / "mycode.py").write_text(
        textwrap.dedent(
            """
            import torch
            def build(seed):
                data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
                return data, data
            """
        )
    )
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 4, out_features: 2}\n"
        f"data:\n  build: !pyobject mycode.build\nlogging:\n  root: {tmp_path / 'runs'}\n" + body
    )
    return path


def test_a_bad_variable_fails_before_spawn_unless_the_config_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDP_FIND_UNUSED_PARAMETERS", "maybe")
    c = load_config(_config_file(tmp_path, ""))
    with pytest.raises(ConfigError) as info:
        unison.recipe.build.preflight.preflight(plan(c))
    message = str(info.value)
    assert "parallel.find_unused_parameters" in message and "DDP_FIND_UNUSED_PARAMETERS='maybe'" in message
    assert "expected true or false" in message
    given = load_config(_config_file(tmp_path, "parallel:\n  find_unused_parameters: false\n"))
    unison.recipe.build.preflight.preflight(plan(given))  # the config decides: no error
