"""``data.stream`` with files and a reader: resolved before any process starts, each rank its own
samples, a new order each epoch, exact resume; every refusal names its key with file and line
(unison/config/stream_config.py, unison/recipe/planning/stream_files.py, unison/distributed/file_stream.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unison.config import ConfigError, load_config
from unison.distributed import ShardedStream
from unison.recipe.planning.resolved import resolve
from unison.recipe.planning.stream_files import StreamData

READER = """\
import torch


def read(path, scale=1.0):
    for line in path.read_text().split():
        x, y = line.split(",")
        yield torch.tensor([float(x) * scale]), int(y)


def read_at(path, index):
    return index
"""

BODY = """\
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 1, out_features: 2}
training:
  seed: 3
"""

STREAM = """\
data:
  stream:
    files: [shards/train-*.txt]
    val_files: [shards/val.txt]
    reader: !pyobject samples.read
    kwargs: {scale: 1.0}
"""


def _folder(tmp_path: Path, files: int = 3, per_file: int = 5) -> Path:
    (tmp_path / "samples.py").write_text(READER)
    shards = tmp_path / "shards"
    shards.mkdir()
    for f in range(files):
        rows = [f"{f * 100 + i},{i % 2}" for i in range(per_file)]
        (shards / f"train-{f}.txt").write_text("\n".join(rows))
    (shards / "val.txt").write_text("-1,0\n-2,1\n-3,0")
    return tmp_path


def _load(folder: Path, data: str = STREAM, extra: str = "") -> StreamData:
    path = folder / "config.yaml"
    path.write_text(BODY + extra + data)
    built = resolve(load_config(path)).data_build
    assert isinstance(built, StreamData)
    return built


def _error(folder: Path, data: str, extra: str = "") -> str:
    with pytest.raises(ConfigError) as err:
        _load(folder, data, extra)
    return str(err.value)


def _line(folder: Path, text: str) -> int:
    lines = (folder / "config.yaml").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _values(stream: ShardedStream) -> list[int]:
    return [int(x.item()) for x, _ in stream]


def test_each_rank_streams_its_own_samples_in_a_new_order_each_epoch(tmp_path: Path) -> None:
    built = _load(_folder(tmp_path))
    assert [p.name for p in built.files] == ["train-0.txt", "train-1.txt", "train-2.txt"]
    epochs = []
    for epoch in (0, 1):
        shares = []
        for rank in (0, 1):
            train, val = built(seed=3)
            assert len(val) == 3 and int(val[1][0].item()) == -2  # validation: read whole, map-style
            stream = ShardedStream(train.source, rank=rank, world_size=2, equal_length=True)
            stream.set_epoch(epoch)
            shares.append(_values(stream))
        assert len(shares[0]) == len(shares[1]) == 7  # 15 samples: rounds of 2, the last one dropped
        assert not set(shares[0]) & set(shares[1])
        epochs.append(shares)
    assert epochs[0] != epochs[1]  # another file order


def test_a_stream_resumes_where_its_state_says(tmp_path: Path) -> None:
    data = STREAM.replace("    kwargs:", "    shuffle_buffer: 4\n    kwargs:")
    built = _load(_folder(tmp_path), data)
    whole, _ = built(seed=3)
    whole.set_epoch(2)
    everything = _values(whole)
    assert sorted(everything) == sorted(f * 100 + i for f in range(3) for i in range(5))
    first, _ = built(seed=3)
    first.set_epoch(2)
    items = iter(first)
    head = [int(next(items)[0].item()) for _ in range(6)]
    again, _ = built(seed=3)
    again.load_state_dict(first.state_dict())
    assert head + _values(again) == everything


def test_stream_files_are_checked_before_any_process_starts(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    config = folder / "config.yaml"
    message = _error(folder, STREAM.replace("train-*.txt", "test-*.txt"))
    assert message.startswith(f"{config}:{_line(folder, 'files:')}: data.stream.files.0:")
    assert "'shards/test-*.txt' matched no file" in message
    message = _error(folder, STREAM.replace("shards/val.txt", "../val.txt"))
    assert "data.stream.val_files.0" in message and "stays inside the config's folder" in message
    outside = folder.parent / f"{folder.name}-outside.txt"
    outside.write_text("5,1")
    (folder / "shards" / "train-9.txt").symlink_to(outside)  # a glob's match that leads out of the folder
    message = _error(folder, STREAM)
    assert "data.stream.files.0" in message and "train-9.txt, which is refused" in message
    (folder / "shards" / "train-9.txt").unlink()
    message = _error(folder, STREAM.replace("samples.read\n", "samples.read_at\n"))
    assert message.startswith(f"{config}:{_line(folder, 'reader:')}: data.stream.reader:")
    assert "(path, index)" in message and "data.files and data.reader" in message
    message = _error(folder, STREAM.replace("samples.read\n", "os.remove\n"))
    assert "data.stream.reader" in message
    message = _error(folder, STREAM.replace("{scale: 1.0}", "{scael: 1.0}"))
    assert "data.stream.kwargs.scael" in message and "'scale'" in message
    message = _error(folder, STREAM.replace("    reader: !pyobject samples.read\n", ""))
    assert "data.stream.files needs data.stream.reader" in message
    message = _error(folder, STREAM.replace("    val_files: [shards/val.txt]\n", ""))
    assert "needs data.stream.val_files" in message
    message = _error(folder, STREAM + "  split: [0.5, 0.5]\n")
    assert (
        message.startswith(f"{config}:{_line(folder, 'split:')}: data.split:")
        and "data.stream (line" in message
    )
    message = _error(folder, STREAM + "  build: !pyobject samples.read\n")
    assert "data.build:" in message and "Keep one of them" in message
    message = _error(folder, STREAM + "    hf_dataset: hf\n")
    assert "data.stream.hf_dataset" in message and "Keep one of them" in message
    message = _error(folder, STREAM + "    columns: [x]\n")
    assert "data.stream.columns" in message and "drop it" in message
    message = _error(folder, STREAM, "  shuffle: true\n")
    assert message.startswith(f"{config}:{_line(folder, 'shuffle: true')}: training.shuffle:")
    assert "Remove training.shuffle" in message
    assert torch.is_tensor(_load(folder).reader(folder / "shards" / "val.txt").__next__()[0])


RUN = """\
name: empty
training:
  seed: 3
  max_epochs: 2
  batch_size: 2
  loss: !pyobject torch.nn.functional.cross_entropy
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {lr: 0.1}
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 1, out_features: 2}
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
logging:
  progress: false
"""


@pytest.mark.timeout(200)
def test_a_stream_that_yields_nothing_fails_naming_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from unison.cli import main

    folder = _folder(tmp_path)
    config = folder / "config.yaml"
    config.write_text(RUN + STREAM)
    line = _line(folder, "files:")
    for shard in (folder / "shards").glob("train-*.txt"):
        shard.write_text("")
    root = ["--set", f"logging.root={tmp_path / 'runs'}"]
    assert main(["run", str(config), *root]) == 2  # every file is empty: refused before any rank starts
    err = capsys.readouterr().err
    assert f"{config}:{line}: data.stream.files:" in err and "every file it names is empty" in err
    assert "train-0.txt" in err and not (tmp_path / "runs").exists()
    for shard in (folder / "shards").glob("train-*.txt"):
        shard.write_text("\n\n")  # not empty, and the reader yields nothing from it
    assert main(["run", str(config), *root]) != 0
    captured = capsys.readouterr()
    assert f"{config}:{line}: data.stream.files:" in captured.err, captured.err
    assert "no batch" in captured.err and "samples.read" in captured.err and "train-0.txt" in captured.err
    assert "train loss nan" not in captured.err + captured.out
