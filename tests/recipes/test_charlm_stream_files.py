"""recipes/charlm/stream_files.yaml: charlm's text streamed from the shard files that ship with the
recipe (data.stream), trained at two ranks, every window once an epoch across the ranks; a run
resumed from a checkpoint saved inside the first epoch, before the epoch's length is known, ends
with the uninterrupted run's weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from unison.config import load_config
from unison.distributed import ShardedStream
from unison.recipe.phases import run
from unison.recipe.planning.resolved import resolve

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes" / "charlm" / "stream_files.yaml"
SMALL = [
    "training.max_epochs=2",
    "training.batch_size=4",
    "data.stream.kwargs.limit=200",  # 6 windows of 32 per shard file, 8 files: 48 windows, 6 iterations an epoch
    "data.stream.kwargs.block=32",
    "model.kwargs.block=32",
    "model.kwargs.dim=16",
    "model.kwargs.heads=2",
    "model.kwargs.layers=1",
    "logging.progress=false",
    "hooks.after_training=null",
    "checkpoint.every_iters=4",
    "checkpoint.keep_last=null",
]


def _key(window: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    return tuple(window[0].tolist()) + (int(window[1][-1]),)


def test_every_window_goes_to_one_rank_once_an_epoch_in_a_new_order() -> None:
    built = resolve(load_config(CONFIG, SMALL)).data_build
    source = built(seed=0)[0].source
    every = sorted(_key(w) for path in source.files for w in source.reader(path, **source.kwargs))
    assert len(every) == 48
    orders = []
    for epoch in (0, 1):
        shares = []
        for rank in (0, 1):
            share = ShardedStream(built(seed=0)[0].source, rank=rank, world_size=2, equal_length=True)
            share.set_epoch(epoch)
            shares.append([_key(w) for w in share])
        assert len(shares[0]) == len(shares[1]) == 24
        assert sorted(shares[0] + shares[1]) == every  # each window once, on one rank
        orders.append(shares[0])
    assert orders[0] != orders[1]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=False)["objects"]["model"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stream_files_charlm_trains_at_two_ranks_and_resumes_inside_the_first_epoch(tmp_path: Path) -> None:
    whole = run(CONFIG, nproc=2, overrides=[*SMALL, f"logging.root={tmp_path}"])
    assert (whole["epochs"], whole["iterations"]) == (2, 12)  # 24 windows a rank, batches of 4
    run_dir = Path(whole["run_dir"])
    final = _weights(run_dir / "checkpoints" / "ckpt-e0002-i000000012.pt")

    again = run_dir.parent / "resumed"
    shutil.copytree(run_dir, again)
    middle = again / "checkpoints" / "ckpt-e0001-i000000004.pt"  # the epoch's length is not known yet
    assert torch.load(middle, weights_only=False)["trainer"]["epoch_length"] is None
    for later in again.glob("checkpoints/ckpt-*.pt"):
        if later.name > middle.name:
            later.unlink()  # what the resumed run ends with, it writes itself
    resumed = run(CONFIG, nproc=2, overrides=[*SMALL, f"logging.root={tmp_path}"], resume=str(middle))
    assert Path(resumed["run_dir"]) == again and resumed["iterations"] == 12
    ended = _weights(again / "checkpoints" / "ckpt-e0002-i000000012.pt")
    assert ended.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(ended[name], value), name
    assert not torch.equal(_weights(middle)["head.weight"], final["head.weight"])  # it did train on
