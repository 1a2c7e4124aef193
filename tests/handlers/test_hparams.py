"""HParamsLogger: a run's settings as an HParams session, read back with TensorBoard's own reader."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from unison.config import Config, load_config, to_plain
from unison.config.loader import PyObjectRef
from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers.hparams import HParamsLogger
from unison.handlers.tensorboard import TensorBoardLogger
from unison.metrics import Loss
from unison.recipe.build.tracking_tb import LEFT_OUT, hparams_of
from unison.utils.event_files import event_files, read_scalars

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing import plugin_event_accumulator  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, metadata  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HPARAMS = {"training.lr": 0.05, "training.batch_size": 4, "model": "Linear", "training.amp_on": False}


def _session(log_dir: Path) -> tuple[Any, Any, plugin_event_accumulator.EventAccumulator]:
    """The session's start and end info, as TensorBoard's HParams plugin reads them."""
    acc = plugin_event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
    return start, end, acc


def _values(start: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in start.hparams.items():
        kind = value.WhichOneof("kind")
        out[name] = getattr(value, kind)
    return out


def _trainer(log_dir: Path, *, scalars: bool = True, fail_at: int | None = None) -> tuple[Engine, DataLoader]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = create_trainer(model, optimizer, F.mse_loss)
    evaluator = create_evaluator(model, {"loss": Loss(F.mse_loss)})
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(loader))
    if scalars:
        TensorBoardLogger(log_dir, trainer=trainer, evaluators={"val": evaluator}).attach()
    HParamsLogger(log_dir, HPARAMS, trainer=trainer).attach()
    if fail_at is not None:

        def fail(engine: Engine) -> None:
            if engine.state.iteration == fail_at:
                raise RuntimeError("boom")

        trainer.add_event_handler(Events.ITERATION_COMPLETED, fail)
    return trainer, loader


def test_the_session_holds_the_hparams_and_the_scalars_survive(tmp_path: Path) -> None:
    trainer, loader = _trainer(tmp_path)
    before = read_scalars(tmp_path)
    trainer.run(loader, max_epochs=2)
    start, end, acc = _session(tmp_path)
    assert _values(start) == HPARAMS  # numbers come back as float64: 4 == 4.0
    assert end.status == api_pb2.STATUS_SUCCESS
    assert start.start_time_secs <= end.end_time_secs
    # The scalars' file is intact beside it (tensorboardX names files by the second and
    # truncates one of the same name: the session's file has a name of its own).
    assert not before
    ours = read_scalars(tmp_path)
    assert [s for s, _ in ours["train/loss"]] == [3, 6]
    theirs = {e.step: e for e in acc.Tensors("train/loss")}
    assert sorted(theirs) == [3, 6]
    assert len(event_files(tmp_path)) == 2


def test_a_stopped_run_writes_once(tmp_path: Path) -> None:
    trainer, loader = _trainer(tmp_path, scalars=False)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate())
    trainer.run(loader, max_epochs=3)
    files = event_files(tmp_path)
    assert len(files) == 1  # TERMINATE wrote it; COMPLETED, fired after, did not write again
    start, end, _ = _session(tmp_path)
    assert end.status == api_pb2.STATUS_SUCCESS and _values(start) == HPARAMS


def test_a_failed_run_is_recorded_as_a_failure_and_its_error_kept(tmp_path: Path) -> None:
    trainer, loader = _trainer(tmp_path, scalars=False, fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.run(loader, max_epochs=2)
    _, end, _ = _session(tmp_path)
    assert end.status == api_pb2.STATUS_FAILURE


def test_values_out_of_tensorboards_types_are_refused_or_shown_as_text(tmp_path: Path) -> None:
    trainer = create_trainer(torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1), F.mse_loss)
    with pytest.raises(TypeError, match=r"hparams=\{'layers': \[1, 2\]\}.*number, bool or str"):
        HParamsLogger(tmp_path, {"layers": [1, 2]}, trainer=trainer)  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="needs an Engine"):
        HParamsLogger(tmp_path, {}, trainer=object())  # type: ignore[arg-type]
    logger = HParamsLogger(tmp_path, {"a": None, "b": math.nan, "c": 2}, trainer=trainer)
    assert sorted(logger.hparams) == ["b", "c"]  # None is left out
    assert logger.write() is not None
    assert logger.write() is None  # once per run
    start, _, _ = _session(tmp_path)
    assert _values(start) == {"b": "nan", "c": 2.0}


def _config_value(config: Config, dotted: str) -> Any:
    """The truth for one hparam: the config read by attribute, key by key."""
    value: Any = config
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value.path if isinstance(value, PyObjectRef) else value


def test_hparams_of_a_config_are_its_scalar_settings() -> None:
    config = load_config(ROOT / "recipes" / "digits" / "config.yaml", ["training.lr=0.01"])
    hp = hparams_of(config)
    for name, value in hp.items():
        assert _config_value(config, name) == value, name
    # Every number, bool, str and reference outside the left-out sections is there; lists are not.
    expected: set[str] = set()

    def walk(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{name}.{key}" if name else key)
        elif isinstance(value, (bool, int, float, str)):
            expected.add(name)

    walk({k: v for k, v in to_plain(config).items() if k not in LEFT_OUT}, "")
    assert set(hp) == expected
    assert hp["training.optimizer_type"] == "torch.optim.Adam"  # a !pyobject as its dotted path
    assert hp["training.lr"] == 0.01 and hp["model.kwargs.channels"] == 16
    assert hp["validation.metrics.accuracy"] == "unison.metrics.Accuracy"
    assert not any(name.startswith("tuning.") for name in hp)
    assert "imports" not in hp  # a list
