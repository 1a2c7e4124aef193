"""The manifest of a checkpoint folder: only complete files, reconciled with the folder after a crash."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from unison.checkpoint import Entry, Manifest, atomic_save
from unison.checkpoint.manifest import _NAME, MANIFEST, checkpoint_name


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_of_unison():
    handler, logger = _Warnings(), logging.getLogger("unison")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def _write(folder, epoch: int, iteration: int, score: float | None = None, prefix: str = "ckpt"):
    return atomic_save(
        {"meta": {"score": score}, "w": torch.full((4,), float(iteration))},
        folder / checkpoint_name(prefix, epoch, iteration),
    )


def _recorded(folder, *entries: Entry) -> None:
    manifest = Manifest(folder)
    for entry in entries:
        manifest.add(entry)
    manifest.write()


@pytest.mark.parametrize(
    "prefix, epoch, iteration", [("ckpt", 1, 5), ("model-best", 12, 123456789), ("a-e1-i2", 0, 0)]
)
def test_checkpoint_names_parse_back(prefix, epoch, iteration):
    match = _NAME.match(checkpoint_name(prefix, epoch, iteration))
    assert match is not None
    assert (match["prefix"], int(match["epoch"]), int(match["iteration"])) == (prefix, epoch, iteration)


def test_names_sort_in_iteration_order():
    names = [checkpoint_name("ckpt", e, i) for e, i in [(1, 9), (2, 10), (3, 100), (10, 1000)]]
    assert sorted(names) == names


def test_a_new_folder_has_an_empty_manifest(tmp_path):
    manifest = Manifest(tmp_path / "new").rebuild()
    assert manifest.entries == [] and (tmp_path / "new").is_dir()


def test_write_then_rebuild_round_trips_the_entries(tmp_path):
    _write(tmp_path, 1, 5, 0.5)
    _write(tmp_path, 2, 10, 0.25)
    entries = [
        Entry(checkpoint_name("ckpt", 2, 10), 2, 10, 0.25, 2.0, 7),
        Entry(checkpoint_name("ckpt", 1, 5), 1, 5, 0.5, 1.0, 3),
    ]
    _recorded(tmp_path, *entries)
    rebuilt = Manifest(tmp_path).rebuild()
    assert rebuilt.entries == sorted(entries, key=lambda e: e.iteration)
    assert [e.iteration for e in rebuilt.newest()] == [10, 5]
    assert json.loads((tmp_path / MANIFEST).read_text())["version"] == 1


def test_rebuild_adds_complete_files_the_manifest_missed_with_their_score(tmp_path, warnings_of_unison):
    _write(tmp_path, 1, 5, 0.5)
    _recorded(tmp_path, Entry(checkpoint_name("ckpt", 1, 5), 1, 5, 0.5))
    crashed = _write(tmp_path, 2, 10, 0.75)  # written, then a crash before the manifest was
    entries = Manifest(tmp_path).rebuild().entries
    assert [(e.file, e.epoch, e.iteration, e.score) for e in entries] == [
        (checkpoint_name("ckpt", 1, 5), 1, 5, 0.5),
        (crashed.name, 2, 10, 0.75),
    ]
    assert entries[1].size == crashed.stat().st_size
    assert any(crashed.name in m for m in warnings_of_unison)


def test_rebuild_drops_entries_whose_file_is_gone(tmp_path):
    _write(tmp_path, 2, 10)
    _recorded(
        tmp_path, Entry(checkpoint_name("ckpt", 1, 5), 1, 5), Entry(checkpoint_name("ckpt", 2, 10), 2, 10)
    )
    assert [e.file for e in Manifest(tmp_path).rebuild().entries] == [checkpoint_name("ckpt", 2, 10)]


def test_rebuild_ignores_incomplete_foreign_and_unloadable_files(tmp_path):
    good = _write(tmp_path, 1, 5)
    truncated = _write(tmp_path, 2, 10)
    truncated.write_bytes(truncated.read_bytes()[:100])
    _write(tmp_path, 3, 15, prefix="other")
    (tmp_path / "ckpt-final.pt").write_bytes(good.read_bytes())  # not a checkpoint name
    torch.save({"x": object.__new__(_Foreign)}, tmp_path / checkpoint_name("ckpt", 4, 20))
    assert [e.file for e in Manifest(tmp_path).rebuild().entries] == [good.name]


class _Foreign:
    pass


def test_rebuild_removes_leftover_temp_files_and_nothing_else(tmp_path):
    _write(tmp_path, 1, 5)
    leftovers = [tmp_path / ".ckpt-e0002-i000000010.pt.abc123.tmp", tmp_path / f".{MANIFEST}.xyz.tmp"]
    keep = [tmp_path / "notes.txt", tmp_path / ".other-e0001-i000000001.pt.q.tmp"]
    for path in leftovers + keep:
        path.write_bytes(b"partial")
    Manifest(tmp_path).rebuild()
    assert not any(p.exists() for p in leftovers)
    assert all(p.exists() for p in keep)


def test_an_unreadable_manifest_is_rebuilt_from_the_folder_with_a_warning(tmp_path, warnings_of_unison):
    _write(tmp_path, 1, 5, 0.1)
    (tmp_path / MANIFEST).write_text('{"checkpoints": [{"file": ')
    entries = Manifest(tmp_path).rebuild().entries
    assert [(e.file, e.score) for e in entries] == [(checkpoint_name("ckpt", 1, 5), 0.1)]
    assert any(MANIFEST in m and "unreadable" in m for m in warnings_of_unison)


def test_add_replaces_an_entry_of_the_same_file_and_remove_drops_entries(tmp_path):
    manifest = Manifest(tmp_path)
    name = checkpoint_name("ckpt", 1, 5)
    manifest.add(Entry(checkpoint_name("ckpt", 2, 10), 2, 10, sequence=1))
    manifest.add(Entry(name, 1, 5, score=0.1, sequence=2))
    manifest.add(Entry(name, 1, 5, score=0.2, sequence=3))
    # newest last by save sequence, although its iteration is the smaller one
    assert [(e.file, e.score) for e in manifest.entries] == [
        (checkpoint_name("ckpt", 2, 10), None),
        (name, 0.2),
    ]
    assert manifest.next_sequence() == 4
    manifest.remove({name})
    assert [e.file for e in manifest.entries] == [checkpoint_name("ckpt", 2, 10)]


@pytest.mark.parametrize("name", ["../../victim.pt", "/etc/passwd", "sub/ckpt-e0001-i000000001.pt", "..", ""])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_and_nothing_is_deleted(tmp_path, name):
    import json

    from unison.checkpoint import CheckpointError, Manifest

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"precious")
    entry = {"file": name, "epoch": 1, "iteration": 1, "score": None}
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "checkpoints": [entry]}))
    with pytest.raises(CheckpointError, match="not a file of the checkpoint folder"):
        Manifest(folder).rebuild()
    assert victim.read_bytes() == b"precious"


def test_rotation_deletes_only_inside_the_folder(tmp_path):
    from unison.checkpoint import CheckpointError
    from unison.checkpoint.entry import file_in

    with pytest.raises(CheckpointError):
        file_in(tmp_path, "../outside.pt")
    assert file_in(tmp_path, "ckpt-e0001-i000000001.pt") == tmp_path / "ckpt-e0001-i000000001.pt"


def test_a_rebuild_removes_planted_links_never_what_they_point_to(tmp_path):
    folder, elsewhere = tmp_path / "checkpoints", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine\n")
    (folder / ".ckpt-e0001-i000000010.dcp.tmp").symlink_to(elsewhere)  # a stale sharded save, as it looks
    (folder / f".{MANIFEST}.abc.tmp").symlink_to(elsewhere / "keep.txt")
    (folder / MANIFEST).symlink_to(elsewhere / "keep.txt")
    manifest = Manifest(folder).rebuild()  # the linked manifest is not read: nothing recorded
    assert manifest.entries == []
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST]  # the stale links are gone
    manifest.write()  # replaces the link itself
    assert not (folder / MANIFEST).is_symlink() and (elsewhere / "keep.txt").read_text() == "mine\n"
