"""A folder written by ``datasets``' ``save_to_disk`` is data from elsewhere (unison/distributed/hf_folder.py):
only regular files inside it are read, and a column that ``datasets`` would decode from a path
or a URL is refused before any row is read."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")  # the [test] extra installs it; Python versions it lacks skip

from unison.distributed.hf_folder import DatasetFolderError  # noqa: E402
from unison.distributed.hf_stream import load_split  # noqa: E402


def _png() -> bytes:
    image = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    image.new("RGB", (2, 2)).save(buf, format="PNG")
    return buf.getvalue()


def _plain(folder: Path, rows: int = 4) -> Path:
    table = {"x": [[float(i), 1.0] for i in range(rows)], "y": [i % 2 for i in range(rows)]}
    datasets.Dataset.from_dict(table).save_to_disk(str(folder))
    return folder


def _arrow(folder: Path) -> Path:
    (name,) = [entry["filename"] for entry in json.loads((folder / "state.json").read_text())["_data_files"]]
    return folder / name


def _name_files(folder: Path, *names: str) -> None:
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": name} for name in names]
    (folder / "state.json").write_text(json.dumps(state))


def test_a_column_decoded_from_a_path_or_url_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    png = _png()
    features = datasets.Features(
        {
            "x": datasets.List(datasets.Value("float32")),
            "image": datasets.Image(),
            "pair": {"pic": datasets.Image()},
            "clips": datasets.List(datasets.Audio()),
            "raw": datasets.Image(decode=False),
        }
    )
    row = {"bytes": png, "path": None}
    table = {"x": [[1.0]], "image": [row], "pair": [{"pic": row}], "clips": [[]], "raw": [row]}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DatasetFolderError) as err:
        load_split(tmp_path / "hf", None)
    message = str(err.value)
    assert "'image' (Image)" in message and "'pair.pic' (Image)" in message and "'clips[]' (Audio)" in message
    assert "'raw'" not in message  # decode=False: its bytes and path are handed over as they are
    assert "Image(decode=False)" in message and "columns" in message
    # Columns left out are never decoded: a dataset with such a column streams the others.
    kept = load_split(tmp_path / "hf", None, ["x", "raw"])
    assert kept[0]["raw"]["bytes"] == png


def test_a_path_or_url_in_a_row_is_never_opened(tmp_path: Path) -> None:
    plain = datasets.Features(
        {
            "image": {"bytes": datasets.Value("binary"), "path": datasets.Value("string")},
            "y": datasets.Value("int64"),
        }
    )
    rows = {
        "image": [
            {"bytes": None, "path": "http://127.0.0.1:9/x.png"},
            {"bytes": None, "path": "/etc/hostname"},
        ]
    }
    datasets.Dataset.from_dict({**rows, "y": [0, 1]}, features=plain).save_to_disk(str(tmp_path / "hf"))
    info = json.loads((tmp_path / "hf" / "dataset_info.json").read_text())
    info["features"]["image"] = {"_type": "Image"}  # a folder edited to decode each row's path or URL
    (tmp_path / "hf" / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DatasetFolderError, match="'image' \\(Image\\)"):
        load_split(tmp_path / "hf", None)[0]  # unchecked, reading the row fetched the URL


@pytest.mark.timeout(60)
def test_a_fifo_among_the_data_files_is_refused_without_opening_it(tmp_path: Path) -> None:
    folder = _plain(tmp_path / "hf")
    arrow = _arrow(folder)
    arrow.unlink()
    os.mkfifo(arrow)  # opening it would wait for a writer for good
    with pytest.raises(DatasetFolderError, match="not a regular file") as err:
        load_split(folder, None)
    assert arrow.name in str(err.value) and "FIFO" in str(err.value)
    (folder / "state.json").unlink()
    os.mkfifo(folder / "state.json")
    with pytest.raises(DatasetFolderError, match="state.json"):
        load_split(folder, None)


def test_state_json_names_only_files_inside_the_folder(tmp_path: Path) -> None:
    folder = _plain(tmp_path / "hf")
    outside = tmp_path / "outside.arrow"
    shutil.copy(_arrow(folder), outside)  # a valid arrow file, outside the folder
    for name in ("../outside.arrow", str(outside), "sub/../../outside.arrow"):
        _name_files(folder, name)
        with pytest.raises(DatasetFolderError, match="inside the folder") as err:
            load_split(folder, None)
        assert repr(name) in str(err.value)
    link = folder / "link.arrow"
    link.symlink_to(outside)  # a link that leads out
    _name_files(folder, "link.arrow")
    with pytest.raises(DatasetFolderError, match="leads out of the folder"):
        load_split(folder, None)
    link.unlink()
    link.symlink_to(_arrow(_plain(folder / "copy")))  # a link that stays inside is a file of the folder
    assert len(load_split(folder, None)) == 4


def test_a_dataset_dict_names_only_splits_inside_it(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"y": [0, 1]})}).save_to_disk(str(folder))
    _plain(tmp_path / "other")
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../other"]}))
    with pytest.raises(DatasetFolderError, match="'../other'"):
        load_split(folder, "train")
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}) + " " * (17 << 20))
    with pytest.raises(DatasetFolderError, match="dataset_dict.json.*larger than"):
        load_split(folder, "train")
