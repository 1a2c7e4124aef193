"""recipes/wordlm: an LSTM whose hidden state carries between batches, held per rank by a handler.

A 2-rank run resumed from a mid-epoch checkpoint ends bitwise as the uninterrupted one (weights
and every rank's hidden state), through the config and through the Python API; a resume at
another world size is refused naming the handler, which cannot divide its streams anew.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _wordlm_workers import train  # noqa: E402

from unison.recipe.phases import run  # noqa: E402
from unison.testing import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes" / "wordlm" / "config.yaml"
SMALL = [
    "training.max_epochs=2",
    "training.batch_size=2",
    "data.kwargs.streams=4",
    "data.kwargs.limit=1200",  # 1080 training words: 4 streams of 26 windows, 26 iterations per epoch
    "data.kwargs.bptt=10",
    "data.kwargs.vocab=200",
    "model.kwargs.vocab=200",
    "model.kwargs.dim=16",
    "validation.batch_size=4",
    "logging.progress=false",
    "checkpoint.every_iters=5",
    "checkpoint.keep_last=null",
]


def _saved(path: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state = torch.load(path, weights_only=True)
    return state["objects"]["model"], state["objects"]["handlers:CarriedState"]["by_rank"]


def _at(run_dir: Path, iteration: int) -> Path:
    return next((run_dir / "checkpoints").glob(f"ckpt-e*-i{iteration:09d}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_run_resumed_mid_epoch_is_the_uninterrupted_one_through_the_config(tmp_path: Path) -> None:
    whole = run(CONFIG, nproc=2, overrides=[*SMALL, f"logging.root={tmp_path}"])
    assert (whole["epochs"], whole["iterations"]) == (2, 52)
    run_dir = Path(whole["run_dir"])
    weights, hidden = _saved(_at(run_dir, 52))
    assert len(hidden) == 2 and not torch.equal(hidden[0]["hidden"][0], hidden[1]["hidden"][0])

    again = run_dir.parent / "resumed"
    shutil.copytree(run_dir, again)
    middle = _at(again, 10)  # inside the first epoch: what a run stopped there left
    for later in again.glob("checkpoints/ckpt-*.pt"):
        if later.name > middle.name:
            later.unlink()
    resumed = run(CONFIG, nproc=2, overrides=[*SMALL, f"logging.root={tmp_path}"], resume=str(middle))
    assert resumed["iterations"] == 52
    ended, ended_hidden = _saved(_at(again, 52))
    for name, value in weights.items():
        assert torch.equal(ended[name], value), name
    for rank in range(2):
        for mine, truth in zip(ended_hidden[rank]["hidden"], hidden[rank]["hidden"], strict=True):
            assert torch.equal(mine, truth), f"rank {rank}'s hidden state"

    one_rank = [*SMALL, "training.batch_size=4", f"logging.root={tmp_path}"]
    with pytest.raises(Exception, match="handlers:CarriedState") as refused:
        run(CONFIG, nproc=1, overrides=one_rank, resume=str(middle))
    assert "load_state_dict_resharded" in str(refused.value) and "world size 2" in str(refused.value)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_same_handler_through_the_python_api(tmp_path: Path) -> None:
    whole = run_distributed(train, str(tmp_path / "whole"), nproc=2, timeout=200)
    shutil.copytree(tmp_path / "whole", tmp_path / "again")
    middle = next((tmp_path / "again").glob("ckpt-e*-i000000006.pt"))  # inside the first epoch
    resumed = run_distributed(train, str(tmp_path / "again"), str(middle), nproc=2, timeout=200)
    for truth, mine in zip(whole, resumed, strict=True):
        assert mine["iterations"] == truth["iterations"]
        for name, value in truth["weights"].items():
            assert torch.equal(mine["weights"][name], value), name
        for a, b in zip(mine["hidden"], truth["hidden"], strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(whole[0]["hidden"][0], whole[1]["hidden"][0])  # each rank its own streams
    (refused,) = [train(str(tmp_path / "one"), str(middle))]  # 1 rank, in this process
    assert "handler:CarriedState" in refused["error"] and "world size 1" in refused["error"]
