"""unison.cli.plot: a PNG of a run's curves, drawn from its TensorBoard event files."""

from __future__ import annotations

import sys

import pytest
import torch
from tensorboardX import SummaryWriter
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from unison.cli.plot import group_tags, plot_run
from unison.engine import Events, create_evaluator, create_trainer
from unison.handlers.tensorboard import TensorBoardLogger
from unison.metrics import Accuracy, Loss

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"




def _tiny_run(run_dir) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    trainer = create_trainer(model, optimizer, F.cross_entropy, clip_grad_norm=5.0)
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)})
    TensorBoardLogger(run_dir / "tb", trainer=trainer, evaluators={"val": evaluator}, log_every=2).attach(
        trainer
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(loader))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: scheduler.step())
    trainer.run(loader, max_epochs=5)


def test_tags_are_grouped_into_panels():
    tags = [
        "train/loss",
        "val/loss",
        "val/accuracy",
        "val/top5",
        "train/lr/0",
        "train/lr/1",
        "train/grad_norm",
        "train/mse",
        "val/mse",
    ]
    assert group_tags(tags) == {
        "loss": ["train/loss", "val/loss"],
        "accuracy": ["val/accuracy", "val/top5"],
        "lr": ["train/lr/0", "train/lr/1"],
        "grad_norm": ["train/grad_norm"],
        "mse": ["train/mse", "val/mse"],
    }
    assert group_tags(["val/mse"]) == {"mse": ["val/mse"]}  # no empty panels


def test_plot_run_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    _tiny_run(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(out).shape
    assert width > 1000 and height > 500  # 3 columns x 2 rows of panels


def test_plot_run_takes_the_event_folder_and_an_out_path(tmp_path):
    pytest.importorskip("matplotlib")
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        for step in range(1, 4):
            writer.add_scalar("val/loss", 1.0 / step, step)
    out = plot_run(tmp_path / "tb", out=tmp_path / "elsewhere" / "plot.png")
    assert out == tmp_path / "elsewhere" / "plot.png"
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r'pip install "unison\[plot\]"'):
        plot_run(tmp_path)


def test_a_folder_without_event_files_is_named(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        plot_run(tmp_path)
