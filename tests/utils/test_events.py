"""unison.utils.events: scalars read back from event files without TensorBoard."""

from __future__ import annotations

import os
import time

import pytest
from tensorboardX import SummaryWriter

from unison.utils.events import event_files, iter_records, read_scalars


def _write(folder, points: dict[str, list[tuple[int, float]]], suffix: str = "") -> None:
    with SummaryWriter(str(folder), filename_suffix=suffix) as writer:
        for tag, series in points.items():
            for step, value in series:
                writer.add_scalar(tag, value, step)
        writer.add_text("notes", "not a scalar", 0)


def test_round_trip(tmp_path):
    _write(tmp_path, {"train/loss": [(1, 0.5), (2, 0.25)], "val/acc": [(2, 0.75)]})
    assert read_scalars(tmp_path) == {"train/loss": [(1, 0.5), (2, 0.25)], "val/acc": [(2, 0.75)]}


def test_values_are_float32(tmp_path):
    _write(tmp_path, {"x": [(0, 0.1)]})
    ((step, value),) = read_scalars(tmp_path)["x"]
    assert step == 0 and value == pytest.approx(0.1, rel=1e-7) and value != 0.1


def test_files_are_read_oldest_first(tmp_path):
    _write(tmp_path, {"x": [(1, 1.0)]}, suffix=".a")
    first = event_files(tmp_path)[0]
    _write(tmp_path, {"x": [(2, 2.0)]}, suffix=".b")
    later = time.time() + 10
    os.utime(first, (later, later))  # names, not modification times, give the order
    assert read_scalars(tmp_path)["x"] == [(1, 1.0), (2, 2.0)]


def test_a_missing_or_empty_folder_has_no_scalars(tmp_path):
    assert read_scalars(tmp_path / "absent") == {}
    assert read_scalars(tmp_path) == {}


def test_a_truncated_last_record_is_ignored(tmp_path):
    _write(tmp_path, {"x": [(1, 1.0), (2, 2.0)]})
    (path,) = event_files(tmp_path)
    data = path.read_bytes()
    for cut in range(1, 30):  # into the last record's data, CRC or header
        path.write_bytes(data[:-cut])
        assert read_scalars(tmp_path)["x"][0] == (1, 1.0)


def test_a_damaged_record_is_skipped_with_a_warning(tmp_path):
    _write(tmp_path, {"x": [(1, 1.0), (2, 2.0), (3, 3.0)]})
    (path,) = event_files(tmp_path)
    lengths = [len(r) for r, _ in iter_records(path)]  # the file version, x@1, x@2, x@3
    data = bytearray(path.read_bytes())
    end_of_x2 = sum(12 + n + 4 for n in lengths[:3]) - 4  # the last byte of x@2's data: its float value
    data[end_of_x2 - 1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="damaged"):
        scalars = read_scalars(tmp_path)
    assert scalars["x"] == [(1, 1.0), (3, 3.0)]


def test_a_damaged_header_ends_the_file_with_a_warning(tmp_path):
    _write(tmp_path, {"x": [(1, 1.0), (2, 2.0)]})
    (path,) = event_files(tmp_path)
    records = [len(r) for r, _ in iter_records(path)]
    data = bytearray(path.read_bytes())
    second = 12 + records[0] + 4 + 12 + records[1] + 4  # header of the third record (x@2)
    data[second] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="header"):
        assert read_scalars(tmp_path)["x"] == [(1, 1.0)]
