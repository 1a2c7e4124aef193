"""``data.stream.hf_dataset``: a Hugging Face dataset saved on disk, streamed with one equal shard
per rank, its validation split evaluated map-style; what is wrong fails before any process starts,
naming the key (unison/recipe/planning/stream_files.py, unison/distributed/hf_stream.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")  # the [test] extra installs it; Python versions it lacks skip

from unison.config import ConfigError, load_config  # noqa: E402
from unison.distributed.data_state import data_position  # noqa: E402
from unison.distributed.hf_stream import hf_stream, load_split  # noqa: E402
from unison.recipe import plan  # noqa: E402
from unison.recipe.build.assemble import build_datasets, build_loaders  # noqa: E402
from unison.recipe.build.stream_data import check_mid_epoch_saves  # noqa: E402
from unison.recipe.planning.resolved import resolve  # noqa: E402
from unison.recipe.planning.stream_files import StreamData  # noqa: E402

BODY = """\
name: hf-stream
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 2, out_features: 2}
training:
  seed: 0
  max_epochs: 2
  batch_size: 2
  loss: !pyobject torch.nn.functional.cross_entropy
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {lr: 0.1}
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
logging:
  progress: false
data:
  stream:
    hf_dataset: hf
    columns: [x, y]
"""


def _save(folder: Path, rows: int = 11) -> None:
    def table(n: int, start: int) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {
                "x": [[float(start + i), 1.0] for i in range(n)],
                "y": [i % 2 for i in range(n)],
                "note": [f"row {start + i}" for i in range(n)],
            }
        )

    datasets.DatasetDict({"train": table(rows, 0), "validation": table(3, 100)}).save_to_disk(
        str(folder / "hf")
    )


def _config(folder: Path, data: str = BODY) -> Path:
    path = folder / "config.yaml"
    path.write_text(data)
    return path


def _firsts(stream: object) -> list[int]:
    return [int(row["x"][0]) for row in stream]  # type: ignore[attr-defined]


def test_each_rank_streams_an_equal_share_and_resumes_from_its_state(tmp_path: Path) -> None:
    _save(tmp_path)
    built = resolve(load_config(_config(tmp_path))).data_build
    assert isinstance(built, StreamData)
    train, val = built(seed=0)
    assert _firsts(train) == list(range(11))  # one rank: every row
    assert len(val) == 3 and val[0]["x"].tolist() == [100.0, 1.0] and set(val[0]) == {"x", "y"}
    table = load_split(tmp_path / "hf", "train", ["x", "y"])
    for workers in (0, 2):
        shares = [_firsts(hf_stream(table, workers=workers, rank=r, world_size=2)) for r in (0, 1)]
        assert len(shares[0]) == len(shares[1])  # 11 rows: the last 11 % shards are left out
        assert sorted(shares[0] + shares[1]) == list(range(11 - 11 % (2 * max(workers, 1))))
    stream = hf_stream(table, rank=1, world_size=2)
    rows = iter(stream)
    head = [int(next(rows)["x"][0]) for _ in range(2)]
    again = hf_stream(table, rank=1, world_size=2)
    again.load_state_dict(stream.state_dict())
    assert head + _firsts(again) == _firsts(hf_stream(table, rank=1, world_size=2))


def test_a_stream_of_a_saved_dataset_loads_in_batches_and_may_save_mid_epoch(tmp_path: Path) -> None:
    _save(tmp_path, rows=8)
    planned = plan(load_config(_config(tmp_path, BODY + "checkpoint:\n  every_iters: 3\n")))
    train_loader, val_loader = build_loaders(planned, build_datasets(planned))
    batches = list(train_loader)
    assert len(batches) == 4 and batches[0]["x"].shape == (2, 2)  # 8 rows, batches of 2; x and y split later
    assert data_position(train_loader).reports  # its position is saved: mid-epoch checkpoints are allowed
    check_mid_epoch_saves(planned, train_loader)
    assert val_loader is not None and sum(len(b["y"]) for b in val_loader) == 3


def test_a_saved_dataset_is_checked_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path)
    config = _config(tmp_path)
    line = next(i for i, text in enumerate(config.read_text().splitlines(), 1) if "hf_dataset" in text)

    def error(data: str) -> str:
        with pytest.raises(ConfigError) as err:
            resolve(load_config(_config(tmp_path, data)))
        return str(err.value)

    message = error(BODY.replace("columns: [x, y]", "columns: [x, label]"))
    assert "data.stream.columns" in message and "['label']" in message and "'note'" in message
    message = error(BODY + "    split: training\n")
    assert "data.stream.split: 'training'" in message and "['train', 'validation']" in message
    message = error(BODY.replace("hf_dataset: hf", "hf_dataset: nowhere"))
    assert message.startswith(f"{config}:{line}: data.stream.hf_dataset:") and "is not a folder" in message
    message = error(BODY + "    val_files: [x.txt]\n")
    assert "data.stream.val_files" in message and "drop it" in message
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a)
    )
    message = error(BODY)
    assert message.startswith(f"{config}:{line}: data.stream.hf_dataset:")
    assert "datasets package is not installed: pip install 'unison[stream]'" in message


@pytest.mark.timeout(120)
def test_a_saved_dataset_that_reads_outside_itself_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import io
    import json
    import os

    from unison.cli import main

    image = pytest.importorskip("PIL.Image")
    png = io.BytesIO()
    image.new("RGB", (2, 2)).save(png, format="PNG")
    rows = {
        "x": [[float(i), 1.0] for i in range(4)],
        "y": [i % 2 for i in range(4)],
        "image": [{"bytes": png.getvalue(), "path": None}] * 4,
    }
    features = datasets.Features(
        {
            "x": datasets.List(datasets.Value("float32")),
            "y": datasets.Value("int64"),
            "image": datasets.Image(),
        }
    )
    table = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict({"train": table, "validation": table}).save_to_disk(str(tmp_path / "hf"))
    config = _config(tmp_path, BODY.replace("    columns: [x, y]\n", ""))
    line = next(i for i, text in enumerate(config.read_text().splitlines(), 1) if "hf_dataset" in text)
    with pytest.raises(ConfigError) as err:
        resolve(load_config(config))
    assert str(err.value).startswith(f"{config}:{line}: data.stream.hf_dataset:")
    assert "'image' (Image)" in str(err.value) and "data.stream.columns" in str(err.value)
    assert isinstance(resolve(load_config(_config(tmp_path))).data_build, StreamData)  # columns [x, y]: fine
    state = tmp_path / "hf" / "train" / "state.json"
    (arrow,) = json.loads(state.read_text())["_data_files"]
    (tmp_path / "hf" / "train" / arrow["filename"]).unlink()
    os.mkfifo(tmp_path / "hf" / "train" / arrow["filename"])  # unchecked, unison run waited on it for good
    assert main(["run", str(config), "--set", f"logging.root={tmp_path / 'runs'}"]) == 2
    message = capsys.readouterr().err
    assert f"{config}:{line}: data.stream.hf_dataset:" in message and "a FIFO" in message
    assert not (tmp_path / "runs").exists()
