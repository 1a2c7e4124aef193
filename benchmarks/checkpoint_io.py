"""Checkpoint file I/O side by side: unison's save and load against the ways they were done
before, and against the disk, in one process, rounds interleaved.

A state of about ``--size-mb`` MB of float32 tensors (Linear(4096, 4096)-sized weights from
512 MB, Linear(2048, 2048)-sized below) is saved and loaded on the CPU, each way once per
round, in an order rotated every round, so that a shared machine's noise hits every way
alike:

    save, torch.save     the durable write (temp file, fsync, rename, fsync the folder) with
                         ``torch.save`` inside: its CRC-32s computed in one thread, each record's
                         before its bytes are written
    save, unison         ``unison.checkpoint.atomic_save``: torch's zip writer with its CRC-32s
                         off, the CRC-32s computed by other threads while the bytes are written
    disk write           a file of the same size in 8 MiB blocks, fsynced (``_disk.py``)

    load, check + load   ``archive_complete`` (every CRC-32, several threads) then
                         ``torch.load(weights_only=True)``: the file read twice
    load, unison         ``unison.checkpoint.load_checkpoint``: each record read once, into its
                         tensor, its CRC-32 checked by other threads as it is read
    disk read            the file read back in 8 MiB blocks

Every load and read starts cold (the file's pages dropped from the cache, ``_disk.drop_cache``).
Reported: each way's median MB/s, its ratio to the disk's (write or read, same rounds), and its
median CPU seconds (all threads: what a loaded machine makes a save wait for). The files of
both saves are compared byte for byte once.

    python benchmarks/checkpoint_io.py --size-mb 1024 --repeats 5
    python benchmarks/checkpoint_io.py --size-mb 101 --repeats 9 --json io.json
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from _disk import drop_cache, mb_per_s, probe  # noqa: E402

WAYS = ("save, torch.save", "save, unison", "disk write", "load, check + load", "load, unison", "disk read")


def state_of(megabytes: float) -> dict[str, Any]:
    import torch

    width = 4096 if megabytes >= 512 else 2048
    count = max(1, round(megabytes * 1e6 / (width * width * 4)))
    gen = torch.Generator().manual_seed(0)
    return {
        "meta": {"epoch": 1},
        "model": {f"w{i}": torch.randn(width, width, generator=gen) for i in range(count)},
    }


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def one_way(way: str, state: Any, folder: Path, nbytes: int) -> tuple[float, float]:
    """Seconds and CPU seconds of one way, once."""
    import torch

    from unison.checkpoint.archive import archive_complete
    from unison.checkpoint.io import _atomic_write, atomic_save, load_checkpoint

    saved = folder / "unison.pt"
    if way.startswith("load") or way == "disk read":
        drop_cache(saved)
    elif way == "save, unison":  # a new file, as a run's save writes: the old one's deletion is not timed
        saved.unlink(missing_ok=True)
    elif way == "save, torch.save":
        (folder / "torch.pt").unlink(missing_ok=True)
    cpu, start = _cpu(), time.perf_counter()
    if way == "save, torch.save":
        _atomic_write(folder / "torch.pt", lambda fh: torch.save(state, fh))
    elif way == "save, unison":
        atomic_save(state, saved)
    elif way == "disk write":
        return probe(folder / "disk", nbytes, read=False)[0], _cpu() - cpu
    elif way == "load, check + load":
        assert archive_complete(saved)
        torch.load(saved, map_location="cpu", weights_only=True)
    elif way == "load, unison":
        load_checkpoint(saved)
    else:
        with open(saved, "rb", buffering=0) as fh:
            buffer = bytearray(8 << 20)
            while fh.readinto(buffer):
                pass
    return time.perf_counter() - start, _cpu() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=101, help="the state's size (default 101)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where files are written (default: a temp folder)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    import torch

    from unison.checkpoint.io import atomic_save

    torch.set_num_threads(1)
    env = C.environment("cpu")
    C.print_environment(env)
    state = state_of(args.size_mb)
    folder = Path(tempfile.mkdtemp(prefix="unison-io-", dir=args.dir))
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        atomic_save(state, folder / "unison.pt")  # warm-up, and the file the loads read
        nbytes = (folder / "unison.pt").stat().st_size
        for round_index in range(args.repeats):
            for way in C.rotated(WAYS, round_index):
                wall, used = one_way(way, state, folder, nbytes)
                seconds[way].append(wall)
                cpu[way].append(used)
        identical = (folder / "torch.pt").read_bytes() == (folder / "unison.pt").read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows, report = [], {}
    for way in WAYS:
        disk = "disk read" if way.startswith("load") or way == "disk read" else "disk write"
        speed = C.median(mb_per_s(nbytes, s) for s in seconds[way])
        own = C.median(mb_per_s(nbytes, s) for s in seconds[disk])
        report[way] = {
            "mb_s": speed,
            "x_disk": speed / own,
            "cpu_s": C.median(cpu[way]),
            "seconds": seconds[way],
        }
        rows.append([way, f"{speed:.0f}", f"{speed / own:.2f}", f"{C.median(cpu[way]):.3f}"])
    C.print_table(
        f"Checkpoint file I/O, {nbytes / 1e6:.0f} MB, median of {args.repeats} interleaved rounds",
        ["way", "MB/s", "x disk", "CPU s"],
        rows,
    )
    print(f"\nunison's file is byte for byte torch.save's: {identical}")
    C.write_json(
        args.json,
        {
            "benchmark": "checkpoint_io",
            "environment": env,
            "mb": nbytes / 1e6,
            "identical": identical,
            "ways": report,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
