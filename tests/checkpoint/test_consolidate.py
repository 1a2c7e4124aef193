"""unison.checkpoint.consolidate: the full weights of either kind of checkpoint, read without a process group.

The truth is the model's own ``state_dict``: what comes back from a checkpoint file, or
from a sharded folder put together, equals it tensor for tensor, with the plain model's
keys, and loads into a fresh model of the plain class with ``strict=True``.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _consolidate_workers import AVERAGE_SEED, TRAINED_SEED, make_model, write_sharded
from torch import nn

from unison.checkpoint.consolidate import (
    CheckpointReader,
    checkpoint_problem,
    full_objects,
    model_weights,
    strip_wrappers,
)
from unison.checkpoint.io import CheckpointError, atomic_save
from unison.checkpoint.sharded_files import CHECKSUMS
from unison.testing import run_distributed


class Net(nn.Module):
    """Parameters, buffers (BatchNorm's running statistics and counter) and a nested submodule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.body = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
            self.head = nn.Linear(6, 2)
            self.body[1].running_mean.uniform_()  # buffers that differ from their initial values
        self.body[1].num_batches_tracked += 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def wrapped_state(model: nn.Module, wrapper: str) -> dict[str, torch.Tensor]:
    """The state_dict of ``model`` inside real wrappers: DataParallel adds DDP's ``module.``."""
    wrap = {
        "plain": lambda: model,
        "ddp": lambda: nn.DataParallel(model),
        "compiled": lambda: torch.compile(model),
        "ddp-compiled": lambda: torch.compile(nn.DataParallel(model)),
        "compiled-ddp": lambda: nn.DataParallel(torch.compile(model)),
    }[wrapper]
    return wrap().state_dict()


WRAPPERS = ["plain", "ddp", "compiled", "ddp-compiled", "compiled-ddp"]


def assert_same(found: dict, truth: dict) -> None:
    assert sorted(found) == sorted(truth)  # a DCP written by several ranks keeps no key order
    for key, value in truth.items():
        assert torch.equal(found[key], value), key
        assert (
            found[key].dtype == value.dtype and found[key].is_contiguous() and found[key].device.type == "cpu"
        )


def loads_into_plain_class(weights: dict, seed: int) -> None:
    fresh = Net(seed + 100)
    fresh.load_state_dict(weights, strict=True)
    assert_same(fresh.state_dict(), Net(seed).state_dict())


def save_file(path: Path, objects: dict) -> Path:
    return atomic_save({"meta": {"epoch": 3, "iteration": 12}, "objects": objects, "trainer": {}}, path)


def save_sharded(folder: Path, sharded: dict, rest_objects: dict | None = None) -> Path:
    """A sharded checkpoint folder as one process writes it: a DCP of ``sharded``, and rest.pt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        dcp.save(sharded, checkpoint_id=folder, no_dist=True)
    meta = {"epoch": 3, "iteration": 12, "sharded": list(sharded)}
    torch.save({"meta": meta, "objects": rest_objects or {}, "trainer": {}}, folder / "rest.pt")
    return folder


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_file_checkpoint_gives_back_the_saved_weights(tmp_path, wrapper):
    model = Net(1)
    path = save_file(tmp_path / "c.pt", {"model": wrapped_state(model, wrapper), "optimizer": {"state": {}}})
    weights = model_weights(path)
    assert_same(weights, model.state_dict())
    loads_into_plain_class(weights, 1)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_sharded_folder_gives_back_the_saved_weights(tmp_path, wrapper):
    model = Net(2)
    folder = save_sharded(tmp_path / "c.dcp", {"model": wrapped_state(model, wrapper)})
    reader = CheckpointReader(folder)
    assert reader.sharded and reader.names() == ["model"] and reader.meta["iteration"] == 12
    weights = reader.weights()
    assert_same(weights, model.state_dict())
    loads_into_plain_class(weights, 2)


@pytest.mark.parametrize("sharded", [True, False], ids=["ema-sharded", "ema-in-rest"])
def test_the_ema_average_comes_back_from_either_place(tmp_path, sharded):
    model, average = Net(3), Net(4)
    ema = {"weights": average.state_dict(), "n_averaged": 5, "updates": 11}
    if sharded:
        path = save_sharded(tmp_path / "c.dcp", {"model": model.state_dict(), "handler:EMA": ema})
    else:
        path = save_sharded(tmp_path / "c.dcp", {"model": model.state_dict()}, {"handler:EMA": ema})
    assert_same(model_weights(path, ema=True), average.state_dict())
    assert_same(model_weights(path), model.state_dict())
    state = full_objects(path, ["handler:EMA"])["handler:EMA"]
    assert state["n_averaged"] == 5 and state["updates"] == 11


def test_full_objects_reads_every_object_of_a_sharded_folder_as_plain_values(tmp_path):
    model = Net(5)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    folder = save_sharded(
        tmp_path / "c.dcp", {"model": model.state_dict()}, {"optimizer": optimizer.state_dict()}
    )
    objects = full_objects(folder)
    assert list(objects) == ["optimizer", "model"]
    assert_same(objects["model"], model.state_dict())
    saved = optimizer.state_dict()
    assert objects["optimizer"]["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(objects["optimizer"]["state"][index][name], value)
    with pytest.raises(CheckpointError, match=r"holds no object 'scheduler'; it holds 'optimizer', 'model'"):
        full_objects(folder, ["scheduler"])


def test_asking_for_the_average_of_a_checkpoint_without_one_says_so(tmp_path):
    path = save_file(tmp_path / "c.pt", {"model": Net().state_dict(), "optimizer": {}})
    with pytest.raises(
        CheckpointError, match=r"no EMA average \(its objects: model, optimizer\).*leave out --ema"
    ):
        model_weights(path, ema=True)


def test_wrapper_prefixes_go_only_where_a_wrapper_put_them():
    assert strip_wrappers({"module.a.w": 1, "module.b.w": 2}) == {"a.w": 1, "b.w": 2}
    # a submodule named "module" beside others is the model's own name
    assert strip_wrappers({"module.w": 1, "head.w": 2}) == {"module.w": 1, "head.w": 2}
    # a compiled submodule, and wrappers in either order
    assert strip_wrappers({"enc._orig_mod.w": 1, "head.w": 2}) == {"enc.w": 1, "head.w": 2}
    assert strip_wrappers({"_orig_mod.module.w": 1}) == strip_wrappers({"module._orig_mod.w": 1}) == {"w": 1}
    with pytest.raises(CheckpointError, match="clash"):
        strip_wrappers({"enc._orig_mod.w": 1, "enc.w": 2})


def test_a_truncated_file_is_named_with_what_is_wrong(tmp_path):
    path = save_file(tmp_path / "c.pt", {"model": Net().state_dict()})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "truncated or corrupt" in checkpoint_problem(path)
    with pytest.raises(CheckpointError, match=rf"{path}.*truncated or corrupt"):
        model_weights(path)


def _shard_of(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


@pytest.mark.parametrize(
    "damage", ["missing shard", "truncated shard", "no rest.pt", "no .metadata", "checksum"]
)
def test_a_damaged_sharded_folder_is_named_with_what_is_wrong(tmp_path, damage):
    folder = save_sharded(tmp_path / "c.dcp", {"model": Net().state_dict()})
    shard = _shard_of(folder)
    expected = {
        "missing shard": rf"its shard file {shard.name}, listed in \.metadata, is missing",
        "truncated shard": rf"its shard file {shard.name} holds \d+ bytes where \.metadata records \d+ \(truncated\)",
        "no rest.pt": r"it holds no rest\.pt",
        "no .metadata": r"it has no \.metadata",
        "checksum": rf"its file {shard.name} is corrupt \(its CRC-32 differs",
    }[damage]
    if damage == "missing shard":
        shard.unlink()
    elif damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "no rest.pt":
        (folder / "rest.pt").unlink()
    elif damage == "no .metadata":
        (folder / ".metadata").unlink()
    else:  # the same size, one byte flipped: only the recorded CRC-32 tells
        import json
        import zlib

        data = shard.read_bytes()
        (folder / CHECKSUMS).write_text(
            json.dumps({"files": {shard.name: {"size": len(data), "crc32": zlib.crc32(data)}}})
        )
        assert checkpoint_problem(folder) is None
        shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=rf"{folder} cannot be read: {expected}"):
        model_weights(folder)


class Payload:
    """Anything a pickle may build on loading: never a part of a checkpoint."""

    def __reduce__(self):
        return (Path.touch, (Path("pwned"),))


def test_a_sharded_folder_runs_no_code_from_its_metadata(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = save_sharded(tmp_path / "c.dcp", {"model": Net().state_dict()})
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    assert re.search(
        r"it refers to pathlib(\._local)?\.Path\.touch, which is no part of", checkpoint_problem(folder)
    )  # 3.13: pathlib._local
    with pytest.raises(CheckpointError, match=r"\.metadata does not read"):
        model_weights(folder)
    assert not (tmp_path / "pwned").exists()


def test_a_sharded_value_beyond_plain_data_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = save_sharded(
        tmp_path / "c.dcp", {"model": Net().state_dict(), "handler:X": {"value": Payload()}}
    )
    assert not (tmp_path / "pwned").exists()
    assert_same(model_weights(folder), Net().state_dict())  # the model's shards are fine
    with pytest.raises(CheckpointError, match=r"its value handler:X\.value holds Python objects .*refused"):
        full_objects(folder, ["handler:X"])
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_folder_written_by_two_ranks_gives_back_the_whole_model(tmp_path, strategy):
    folder = tmp_path / "ckpt-e0002-i000000008.dcp"
    ranks = run_distributed(write_sharded, str(folder), strategy, nproc=2, timeout=150)
    truth, average = make_model(TRAINED_SEED).state_dict(), make_model(AVERAGE_SEED).state_dict()
    assert ranks[0]["sharded"] == (strategy == "fsdp")
    if strategy == "ddp":
        assert all(key.startswith("_orig_mod.module.") for key in ranks[0]["keys"])
    assert len(list(folder.glob("*.distcp"))) == 2  # both ranks wrote
    weights = model_weights(folder)
    assert_same(weights, truth)
    assert_same(model_weights(folder, ema=True), average)
    fresh = make_model(9)
    fresh.load_state_dict(weights, strict=True)
