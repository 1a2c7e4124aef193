"""The ``data`` section as QuantumGrav writes it: files read by a reader into one FileDataset,
split with the training seed (unison/config/data_config.py, unison/recipe/planning/file_data.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("zarr")

from _data_section_workers import USER_MODULE, split_on_rank, write_store  # noqa: E402  # needs zarr

from unison.config import ConfigError, load_config  # noqa: E402
from unison.recipe.planning.file_data import FileData, StoreReader  # noqa: E402
from unison.recipe.planning.resolved import resolve  # noqa: E402
from unison.testing import run_distributed  # noqa: E402

SIZES = [[3, 1, 4, 2, 5, 3], [2, 4, 3, 1]]

DATA = """\
data:
  pre_transform: !pyobject qg_data.collect_data
  transform: null
  pre_filter: null
  reader: !pyobject qg_data.read_data
  files:
    - stores/part0.zarr
    - stores/part1.zarr
  output: cache
  validate_data: true
  n_processes: 1
  chunksize: 4
  shuffle: true
  split: [0.5, 0.25, 0.25]
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A config folder: the user's module beside it, and two zarr stores under stores/."""
    (tmp_path / "qg_data.py").write_text(USER_MODULE)
    for k, sizes in enumerate(SIZES):
        write_store(tmp_path / "stores" / f"part{k}.zarr", sizes, seed=k)
    return tmp_path


def _config(folder: Path, data: str = DATA, extra: str = "") -> Path:
    text = "model:\n  type: !pyobject torch.nn.Linear\n  kwargs: {in_features: 2, out_features: 2}\n"
    path = folder / "config.yaml"
    path.write_text(text + "training:\n  seed: 7\n" + data + extra)
    return path


def test_quantumgrav_data_section_builds_one_split_file_dataset(folder: Path) -> None:
    config = load_config(_config(folder))
    file_data = resolve(config).data_build
    assert isinstance(file_data, FileData) and isinstance(file_data.reader, StoreReader)
    train, val, test = file_data(seed=config.training.seed)
    assert (len(train), len(val), len(test)) == (6, 2, 2)  # 10 items: rounding leftovers go to train
    assert sorted(train.indices + val.indices + test.indices) == list(range(10))
    item = val[0]
    assert item["x"].dtype == torch.float32 and item["y"].dtype == torch.int64
    assert (folder / "cache" / "items").is_dir() and train.dataset.built
    again = file_data(seed=config.training.seed)  # a later run: the cache is reused, the split the same
    assert not again[0].dataset.built
    assert [p.indices for p in again] == [train.indices, val.indices, test.indices]
    other = file_data(seed=8)
    assert other[0].indices != train.indices


def test_plain_reader_and_two_way_split(folder: Path) -> None:
    data = DATA.replace("qg_data.read_data", "qg_data.read").replace("[0.5, 0.25, 0.25]", "[0.7, 0.3]")
    file_data = resolve(load_config(_config(folder, data))).data_build
    assert not isinstance(file_data.reader, StoreReader)
    train, val = file_data(seed=0)
    assert (len(train), len(val)) == (7, 3)


def test_float_and_int_types_reach_the_reader(folder: Path) -> None:
    data = DATA + "  float_type: float64\n  int_type: int32\n"
    _, val, _ = resolve(load_config(_config(folder, data))).data_build(seed=0)
    assert val[0]["x"].dtype == torch.float64 and val[0]["y"].dtype == torch.int32


def test_build_and_files_together_is_an_error_naming_both(folder: Path) -> None:
    data = DATA.replace("data:\n", "data:\n  build: !pyobject qg_data.read\n")
    with pytest.raises(ConfigError) as info:
        load_config(_config(folder, data))
    message = str(info.value)
    assert "data.build (line 7)" in message and info.value.key_path == "data.files"
    assert f"{folder / 'config.yaml'}:" in message and info.value.line is not None


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (("[0.5, 0.25, 0.25]", "[0.5, 0.25]"), "data.split"),
        (("[0.5, 0.25, 0.25]", "[0.25, 0.25, 0.25, 0.25]"), "data.split"),
        (("  reader: !pyobject qg_data.read_data\n", ""), "data.files"),
        (("pre_filter: null", "pre_filter: !pyobject qg_data.big_enough\n  kwargs: {a: 1}"), "data.kwargs"),
        (("output: cache", "output: null\n  pre_filter: !pyobject qg_data.big_enough"), None),
    ],
)
def test_bad_data_sections_fail_at_load(folder: Path, change: tuple[str, str], key: str | None) -> None:
    data = DATA.replace(*change)
    if key is None:  # pre_filter is given twice above: keep the second
        data = data.replace("  pre_filter: null\n", "")
        key = "data.pre_filter"
    with pytest.raises(ConfigError) as info:
        load_config(_config(folder, data))
    assert info.value.key_path == key and info.value.line is not None


def test_relative_paths_stay_in_the_config_folder_absolute_ones_are_the_users(folder: Path) -> None:
    outside = folder / "elsewhere"
    outside.mkdir()
    write_store(outside / "part9.zarr", [2, 2], seed=9)
    (folder / "inner").mkdir()
    inner = folder / "inner"
    (inner / "qg_data.py").write_text(USER_MODULE)
    escaping = DATA.replace("stores/part0.zarr", "../elsewhere/part9.zarr").replace("stores/", "../stores/")
    with pytest.raises(ConfigError) as info:
        resolve(load_config(_config(inner, escaping)))
    assert info.value.key_path == "data.files.0" and "absolute" in str(info.value)
    absolute = DATA.replace("stores/part0.zarr", str(outside / "part9.zarr")).replace(
        "stores/part1.zarr", str(folder / "stores" / "part1.zarr")
    )
    file_data = resolve(load_config(_config(inner, absolute))).data_build
    assert file_data.files[0] == outside / "part9.zarr" and file_data.output == (inner / "cache").resolve()


def test_a_missing_file_and_a_reader_of_three_arguments_fail_before_spawn(folder: Path) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(load_config(_config(folder, DATA.replace("part1.zarr", "part7.zarr"))))
    assert info.value.key_path == "data.files.1" and "does not exist" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve(load_config(_config(folder, DATA.replace("qg_data.read_data", "qg_data.read_three"))))
    assert info.value.key_path == "data.reader" and "read_data(" in str(info.value)


def test_yaml_anchors_and_aliases_load(folder: Path) -> None:
    data = DATA.replace("output: cache", "output: *output")
    extra = textwrap.dedent(
        """\
        logging:
          root: *output
        validation: &loader
          batch_size: 4
          num_workers: 0
        testing:
          <<: *loader
          use_best: false
        """
    )
    path = _config(folder, data, extra)
    path.write_text(path.read_text().replace("  seed: 7\n", "  seed: 7\n  path: &output cache\n"))
    config = load_config(path)
    assert config.data.output == config.training.path == config.logging.root == "cache"
    assert config.testing.batch_size == 4 and config.testing.use_best is False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_gets_the_same_split_and_one_rank_preprocesses(folder: Path) -> None:
    results = run_distributed(split_on_rank, str(_config(folder)), nproc=2, timeout=90)
    assert results[0]["indices"] == results[1]["indices"]
    assert sorted(r["built"] for r in results) == [False, True]
