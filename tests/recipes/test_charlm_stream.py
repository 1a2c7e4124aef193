"""recipes/charlm/stream.yaml: charlm's training windows streamed through shard_stream, trained at
two ranks; a run resumed from a mid-epoch checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from unison.recipe.phases import run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes" / "charlm" / "stream.yaml"
SMALL = [
    "training.max_epochs=2",
    "training.batch_size=4",
    "data.kwargs.limit=4000",  # 3600 training characters: 112 windows of 32, 14 iterations per epoch
    "data.kwargs.block=32",
    "model.kwargs.block=32",
    "model.kwargs.dim=16",
    "model.kwargs.heads=2",
    "model.kwargs.layers=1",
    "logging.progress=false",
    "hooks.after_training=null",
    "checkpoint.every_iters=4",
    "checkpoint.keep_last=null",
]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=False)["objects"]["model"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streamed_charlm_trains_at_two_ranks_and_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    whole = run(CONFIG, nproc=2, overrides=[*SMALL, f"logging.root={tmp_path}"])
    assert (whole["epochs"], whole["iterations"]) == (2, 28)  # each rank half of the 112 windows
    assert whole["history"][-1]["val_loss"] < whole["history"][0]["val_loss"] + 1.0
    run_dir = Path(whole["run_dir"])
    final = _weights(run_dir / "checkpoints" / "ckpt-e0002-i000000028.pt")

    again = run_dir.parent / "resumed"
    shutil.copytree(run_dir, again)
    middle = again / "checkpoints" / "ckpt-e0001-i000000008.pt"  # inside the first epoch
    for later in again.glob("checkpoints/ckpt-*.pt"):
        if later.name > middle.name:
            later.unlink()  # what the resumed run ends with, it writes itself
    resumed = run(CONFIG, nproc=2, overrides=[*SMALL, f"logging.root={tmp_path}"], resume=str(middle))
    assert Path(resumed["run_dir"]) == again and resumed["iterations"] == 28
    ended = _weights(again / "checkpoints" / "ckpt-e0002-i000000028.pt")
    assert ended.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(ended[name], value), name
    assert not torch.equal(_weights(middle)["head.weight"], final["head.weight"])  # it did train on
