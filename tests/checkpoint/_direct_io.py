"""The O_DIRECT fixture of the checkpoint tests that count direct writes."""

from __future__ import annotations

import mmap
import os

import pytest


def direct_works(folder) -> bool:
    """Whether the file system of ``folder`` takes an O_DIRECT write (tmpfs before Linux 6.6 does not)."""
    probe = folder / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, 4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def direct_folder(tmp_path):
    """``tmp_path``, where its file system takes O_DIRECT (the tests that count direct writes need it)."""
    if not direct_works(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT: the page cache path is what runs there")
    return tmp_path
