"""The files of a sharded checkpoint folder: their names, their checksums, the folder's size, its removal.

Both sides of a sharded checkpoint build on this: the writing (:mod:`unison.checkpoint.sharded`)
and the checking before a load (:mod:`unison.checkpoint.sharded_check`).
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

SUFFIX = ".dcp"
"""The name ending of a sharded checkpoint folder."""
REST = "rest.pt"
CHECKSUMS = "checksums.json"


def file_checksum(path: Path) -> tuple[int, int]:
    """``(size, crc32)`` of a file, read in 8 MiB blocks into one buffer (``zlib.crc32`` releases the
    GIL on them: the ranks' and the writer thread's checks run side by side)."""
    crc, size = 0, 0
    block = memoryview(bytearray(8 << 20))
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(block):
            crc = zlib.crc32(block[:n], crc)
            size += n
    return size, crc


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def remove(path: Path) -> None:
    """Deletes a checkpoint: a file, or a sharded checkpoint's folder (a link: the link alone)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
