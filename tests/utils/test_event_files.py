"""unison.utils.event_files: scalars read back from event files without TensorBoard."""

from __future__ import annotations

import os
import time

import pytest
from tensorboardX import SummaryWriter

from unison.utils.event_files import event_files, iter_records, read_scalars


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


# -- a resumed run: TensorBoard's purge of orphaned points ----------------------------------------


def _tensorboard_view(folder) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard's own reader shows: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder)).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _frame(data: bytes) -> bytes:
    import struct

    from tensorboardX.record_writer import masked_crc32c

    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def test_a_resumed_writer_purges_the_points_past_its_purge_step_as_tensorboard_does(tmp_path):
    pytest.importorskip("tensorboard")
    with SummaryWriter(str(tmp_path), filename_suffix=".a") as writer:  # a run killed after step 5
        for step in range(1, 6):
            writer.add_scalar("loss", 10.0 + step, step)
        writer.add_scalar("val", 1.0, 2)
        writer.add_scalar("val", 2.0, 4)
    with SummaryWriter(str(tmp_path), filename_suffix=".b", purge_step=3) as writer:  # resumed at step 2
        for step in range(3, 7):
            writer.add_scalar("loss", 20.0 + step, step)
    expected = {"loss": [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0), (6, 26.0)], "val": [(2, 1.0)]}
    assert read_scalars(tmp_path) == expected == _tensorboard_view(tmp_path)


def test_a_restart_marker_inside_a_file_purges_every_tag_before_it(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    with SummaryWriter(str(tmp_path)) as writer:
        for step in (1, 2, 3):
            writer.add_scalar("a", float(step), step)
            writer.add_scalar("b", float(step), step)
        writer._get_file_writer().add_event(Event(step=2, session_log=SessionLog(status=SessionLog.START)))
        writer.add_scalar("a", 5.0, 2)
    assert read_scalars(tmp_path) == {"a": [(1, 1.0), (2, 5.0)], "b": [(1, 1.0)]} == _tensorboard_view(tmp_path)


def test_without_a_file_version_a_step_going_back_purges_its_own_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    def scalar(tag: str, value: float, step: int) -> bytes:
        event = Event(step=step, wall_time=1.0, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)]))
        return _frame(event.SerializeToString())

    points = [("a", 1.0, 1), ("b", 1.0, 1), ("a", 2.0, 2), ("b", 2.0, 2), ("a", 3.0, 3), ("a", 9.0, 2)]
    (tmp_path / "events.out.tfevents.1.old").write_bytes(b"".join(scalar(*p) for p in points))
    assert read_scalars(tmp_path) == {"a": [(1, 1.0), (2, 9.0)], "b": [(1, 1.0), (2, 2.0)]} == _tensorboard_view(tmp_path)
