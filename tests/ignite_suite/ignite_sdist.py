"""ignite's own test suite, taken from its source distribution: downloaded with pip, checked
against a pinned sha256, and its ``tests/`` folder extracted into a gitignored cache.

The cache is ``.cache/ignite-suite/`` at the repository root (``UNISON_IGNITE_SUITE_CACHE``
moves it). A second call finds the extracted tree and does nothing; a changed pin
(version or hash) extracts into a folder of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

IGNITE_VERSION = "0.5.5"
"""The ignite release whose tests define a drop-in Engine (pyproject pins ``>=0.5.5,<0.6``)."""

SDIST_NAME = f"pytorch_ignite-{IGNITE_VERSION}.tar.gz"
SDIST_SHA256 = "2c14de75c939a3cc06d2e7de00b1e0a261917ef9bd874dac2e69d789dfa9cc64"
"""sha256 of ``pytorch_ignite-0.5.5.tar.gz`` as PyPI serves it."""

ROOT = Path(__file__).resolve().parents[2]
PIP_TIMEOUT_S = 600.0
_DONE = ".extracted"  # written last: a tree without it is incomplete


class SuiteFetchError(RuntimeError):
    """The sdist could not be downloaded, did not match its pin, or held an unsafe path."""


def cache_dir() -> Path:
    return Path(os.environ.get("UNISON_IGNITE_SUITE_CACHE", ROOT / ".cache" / "ignite-suite"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_hash(path: Path) -> None:
    actual = sha256_of(path)
    if actual != SDIST_SHA256:
        raise SuiteFetchError(
            f"{path} does not match the pinned sdist of pytorch-ignite {IGNITE_VERSION}: "
            f"expected sha256 {SDIST_SHA256}, got {actual}. Delete the file to download it again; "
            "if the registry really serves another file, review it and update SDIST_SHA256 in "
            "tests/ignite_suite/ignite_sdist.py."
        )


def _pip_download(into: Path) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", f"pytorch-ignite=={IGNITE_VERSION}",
        "--no-binary", ":all:", "--no-deps", "--disable-pip-version-check", "-d", str(into),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        from _procs import kill_tree  # tests/ is on sys.path (see run_ignite_suite.py)

        kill_tree(proc)
        out, _ = proc.communicate()
        raise SuiteFetchError(f"pip download did not finish in {PIP_TIMEOUT_S:g} s:\n{out[-3000:]}") from None
    if proc.returncode != 0:
        raise SuiteFetchError(f"pip download failed (exit {proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")


def fetch_sdist() -> Path:
    """The pinned sdist, downloaded once into the cache and checked on every call."""
    target = cache_dir() / SDIST_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            _pip_download(Path(tmp))
            got = Path(tmp) / SDIST_NAME
            if not got.exists():
                found = sorted(p.name for p in Path(tmp).iterdir())
                raise SuiteFetchError(f"pip download gave {found}, not {SDIST_NAME}")
            _check_hash(got)
            os.replace(got, target)  # a concurrent download of the same bytes may win; both are checked
    _check_hash(target)
    return target


def _tests_members(archive: tarfile.TarFile, into: Path) -> list[tarfile.TarInfo]:
    """The archive's ``<top>/tests/...`` members, renamed to ``tests/...``; refuses any path
    that is absolute, climbs out with ``..``, or is anything but a plain file or folder."""
    top = f"pytorch_ignite-{IGNITE_VERSION}"
    chosen = []
    for member in archive.getmembers():
        parts = PurePosixPath(member.name).parts
        if len(parts) < 2 or parts[0] != top or parts[1] != "tests":
            continue
        inner = PurePosixPath(*parts[1:])
        if inner.is_absolute() or ".." in inner.parts or "\\" in member.name:
            raise SuiteFetchError(f"unsafe path in the sdist: {member.name!r}")
        if not (member.isfile() or member.isdir()):
            raise SuiteFetchError(
                f"the sdist's {member.name!r} is not a plain file or folder (link or device)"
            )
        resolved = (into / inner).resolve()
        if resolved != into.resolve() and into.resolve() not in resolved.parents:
            raise SuiteFetchError(f"{member.name!r} would be written outside {into}")
        member.name = inner.as_posix()
        chosen.append(member)
    if not any(PurePosixPath(m.name).parts[:2] == ("tests", "ignite") for m in chosen):
        raise SuiteFetchError(
            f"{SDIST_NAME} holds no tests/ignite/ folder: ignite's tests are not in this sdist"
        )
    return chosen


def extracted_suite() -> Path:
    """A folder holding ignite's ``tests/`` (its package ``tests.ignite``), extracted once.

    The folder is named after the pinned hash; it is built aside and renamed into place, so a
    run interrupted half-way leaves nothing that looks complete."""
    dest = cache_dir() / f"ignite-{IGNITE_VERSION}-{SDIST_SHA256[:12]}"
    if (dest / _DONE).exists():
        return dest
    sdist = fetch_sdist()
    staging = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".extract-"))
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            members = _tests_members(archive, staging)
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(staging, members=members, **extra)
        (staging / _DONE).write_text(f"{SDIST_NAME} sha256={SDIST_SHA256}\n")
        if dest.exists():  # incomplete leftovers of an earlier try
            shutil.rmtree(dest)
        try:
            os.rename(staging, dest)
        except OSError:
            if not (dest / _DONE).exists():  # not a concurrent extraction that finished first
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return dest
