"""unison.checkpoint.sharded_layout and the folder check: what ``.metadata`` declares must be sound.

A declared tensor whose stored pieces do not cover it exactly, a piece without its bytes,
or a field of another type than DCP writes is refused before any shard is read, naming the
tensor or field and the folder: export never writes uninitialised memory, and a resume never
loads half a tensor. Such a folder was written whole by other code, so it is *unreadable*
(a resume stops), where a truncated one is *damaged* (a resume passes over it).
"""

from __future__ import annotations

import json
import pickle
import warnings
import zlib
from pathlib import Path, PurePath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from unison.checkpoint.consolidate import model_weights
from unison.checkpoint.io import CheckpointError
from unison.checkpoint.sharded_check import _metadata_global, read_metadata, sharded_verdict
from unison.checkpoint.sharded_files import CHECKSUMS


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "c.dcp"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        state = {"model": nn.Linear(3, 2).state_dict(), "handler:X": {"count": 4}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    meta = {"epoch": 1, "iteration": 4, "sharded": ["model", "handler:X"]}
    torch.save({"meta": meta, "objects": {}, "trainer": {}}, folder / "rest.pt")
    return folder


def _rewrite(folder: Path, change) -> None:
    metadata = read_metadata(folder)
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _record_checksums(folder: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())} for p in folder.iterdir()
    }
    (folder / CHECKSUMS).write_text(json.dumps({"files": files}))


WEIGHT = "model.weight"


def _declared(metadata):
    return metadata.state_dict_metadata[WEIGHT]


def _stored(metadata):
    return metadata.storage_data[MetadataIndex(WEIGHT, torch.Size([0, 0]))]


def _overlapping(metadata) -> None:  # a 3x3 tensor: rows 0-1, and rows 1-2 over them: 9 values, overlapping
    declared = _declared(metadata)
    declared.size = torch.Size([3, 3])
    declared.chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 3])),
    ]
    metadata.storage_data[MetadataIndex(WEIGHT, torch.Size([1, 0]))] = _stored(metadata)


CASES = {
    "declared larger than stored": (
        lambda m: setattr(_declared(m), "size", torch.Size([40, 3])),
        r"its tensor model\.weight of shape \[40, 3\] \(120 values\) has stored pieces covering 6 of them",
    ),
    "piece outside": (
        lambda m: setattr(_declared(m).chunks[0], "offsets", torch.Size([1, 0])),
        r"its tensor model\.weight of shape \[2, 3\] declares a piece at \[1, 0\] of shape \[2, 3\], outside it",
    ),
    "overlap": (
        _overlapping,
        r"its tensor model\.weight declares pieces at \[0, 0\] and \[1, 0\] that overlap",
    ),
    "piece without bytes": (
        lambda m: m.storage_data.pop(MetadataIndex(WEIGHT, torch.Size([0, 0]))),
        r"its tensor model\.weight declares a piece at \[0, 0\] with no stored bytes",
    ),
    "piece too short": (
        lambda m: setattr(_stored(m), "length", 5),
        r"its tensor model\.weight stores its piece at \[0, 0\] in 5 bytes, where its 6 values of torch\.float32",
    ),
    "value without bytes": (
        lambda m: m.storage_data.pop(MetadataIndex("handler:X.count")),
        r"its value handler:X\.count, declared in \.metadata, has no stored bytes",
    ),
    "offset of another type": (
        lambda m: setattr(_stored(m), "offset", "abc"),
        r"its \.metadata field storage_data\[model\.weight\]\.offset is 'abc' \(str\), expected an integer >= 0",
    ),
    "a list for the storage dict": (
        lambda m: setattr(m, "storage_data", [1]),
        r"its \.metadata field storage_data is \[1\] \(list\), expected a dict",
    ),
    "a list for the declared values": (
        lambda m: setattr(m, "state_dict_metadata", []),
        r"its \.metadata field state_dict_metadata is \[\] \(list\), expected a dict",
    ),
    "a size of strings": (
        lambda m: setattr(_declared(m), "size", ["2", "3"]),
        r"its \.metadata field state_dict_metadata\[model\.weight\]\.size is \['2', '3'\] \(list\), expected a torch\.Size",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unsound_layout_is_refused_naming_the_tensor_and_the_folder(tmp_path, case):
    change, expected = CASES[case]
    folder = _folder(tmp_path)
    _rewrite(folder, change)
    with pytest.raises(CheckpointError, match=rf"{folder} cannot be read: {expected}"):
        model_weights(folder)
    _record_checksums(folder)  # written whole: this software cannot read it, a resume must not pass it by
    problem = sharded_verdict(folder)
    assert problem is not None and problem.unreadable, problem


def test_a_sound_folder_passes_and_a_truncated_one_is_damaged(tmp_path):
    folder = _folder(tmp_path)
    _record_checksums(folder)
    assert sharded_verdict(folder) is None
    assert torch.equal(model_weights(folder)["weight"], _declared_weight())
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    problem = sharded_verdict(folder)
    assert problem is not None and not problem.unreadable and "holds" in problem.text


def _declared_weight() -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Linear(3, 2).weight.detach()


def _with_global(folder: Path, old: str, new: str) -> None:
    """Rewrites ``.metadata`` (unframed, protocol 2) with the global ``old`` (module.name) named ``new``."""
    data = pickle.dumps(read_metadata(folder), protocol=2)
    named = [
        b"c" + text.rsplit(".", 1)[0].encode() + b"\n" + text.rsplit(".", 1)[1].encode() + b"\n"
        for text in (old, new)
    ]
    assert data.count(named[0]) == 1
    (folder / ".metadata").write_bytes(data.replace(named[0], named[1]))


def test_a_refused_class_is_unreadable_and_a_cut_metadata_damaged(tmp_path):
    folder = _folder(tmp_path)
    data = (folder / ".metadata").read_bytes()
    info = "torch.distributed.checkpoint.filesystem._StorageInfo"
    _with_global(folder, info, "subprocess.Popen")
    assert "it refers to subprocess.Popen" in sharded_verdict(folder, require_checksums=False).text
    assert sharded_verdict(folder, require_checksums=False).unreadable
    (folder / ".metadata").write_bytes(data[: len(data) // 2])
    assert not sharded_verdict(folder, require_checksums=False).unreadable


def test_paths_pickled_by_python_3_13_read_everywhere(tmp_path):
    folder = _folder(tmp_path)
    _with_global(
        folder,
        f"{type(Path()).__module__}.{type(Path()).__name__}",
        f"pathlib._local.{type(Path()).__name__}",
    )
    assert sharded_verdict(folder, require_checksums=False) is None
    checkpoint_id = read_metadata(folder).storage_meta.checkpoint_id
    assert isinstance(checkpoint_id, PurePath) and Path(checkpoint_id) == folder
    assert torch.equal(model_weights(folder)["weight"], _declared_weight())


def test_a_dcp_class_is_found_at_either_of_its_modules():
    from torch.distributed.checkpoint.metadata import Metadata

    assert _metadata_global("torch.distributed.checkpoint.filesystem", "Metadata") is Metadata
    assert _metadata_global("torch.distributed.checkpoint.filesystem", "Path") is None  # not a DCP class
    assert _metadata_global("pathlib._local", "Path") is None  # only the four path classes
