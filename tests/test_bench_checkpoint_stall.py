"""benchmarks/checkpoint_stall.py sets each save's throughput against the disk's own, measured
in the same rounds; here on a tiny model, in this process, without the 2-rank sharded save."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def test_the_disk_probe_writes_the_bytes_asked_and_leaves_nothing(tmp_path):
    disk = _module("_disk")
    seconds = disk.write_seconds(tmp_path / "probe", 3 << 20)
    assert seconds > 0 and list((tmp_path / "probe").iterdir()) == []
    (tmp_path / "ckpt" / "shards").mkdir(parents=True)
    (tmp_path / "ckpt" / "rest.pt").write_bytes(b"x" * 10)
    (tmp_path / "ckpt" / "shards" / "0.distcp").write_bytes(b"y" * 32)
    assert (
        disk.folder_bytes(tmp_path / "ckpt") == 42 and disk.folder_bytes(tmp_path / "ckpt" / "rest.pt") == 10
    )
    assert disk.mb_per_s(4e6, 2.0) == 2.0


def test_every_way_of_the_disk_probe_writes_the_bytes_asked(tmp_path):
    disk = _module("_disk")
    nbytes = disk.DEEP * 2 + 4096 * 3 + 17  # two whole calls, a short one, and a tail of part of a page
    source = disk._aligned(bytes(range(256)) * (disk.DEEP // 256))
    for direct in disk._WAYS:
        path = tmp_path / f"deep-{direct}.bin"
        assert disk._write_deep(path, nbytes, source, direct) > 0
        data = path.read_bytes()
        assert len(data) == nbytes and data[: disk.DEEP] == source[: disk.DEEP]
        assert data[2 * disk.DEEP : 2 * disk.DEEP + 4096] == source[:4096]
        assert disk._read_deep(path, direct) > 0
    ways = disk.probe_ways(tmp_path / "probe", 1 << 20)
    written_direct = [disk.WRITTEN_DIRECT] if disk._O_DIRECT else []
    assert sorted(ways) == sorted(
        [
            name
            for direct in disk._WAYS
            for name in (disk._NAMES[direct], f"{disk._NAMES[direct]}, 3 x 32 MiB at once")
        ]
        + written_direct
    )
    assert all(read > 0 for _, read in ways.values())
    assert list((tmp_path / "probe").iterdir()) == []


def test_the_disks_speed_is_the_faster_ways_median_not_each_rounds_luckier_sample():
    disk = _module("_disk")
    rounds = [  # (write, read) seconds: the page cache is the faster writer at its median, O_DIRECT the reader
        {"page cache": (1.0, 5.0), "O_DIRECT": (0.5, 2.0)},
        {"page cache": (1.0, 5.0), "O_DIRECT": (3.0, 2.0)},
        {"page cache": (1.0, 5.0), "O_DIRECT": (3.0, 2.0)},
    ]
    assert disk.faster_way(rounds, 0) == (
        "page cache",
        [1.0, 1.0, 1.0],
    )  # round by round it would be 0.5, 1, 1
    assert disk.faster_way(rounds, 1) == ("O_DIRECT", [2.0, 2.0, 2.0])


def test_a_resume_is_also_set_against_a_file_written_as_its_own_was():
    disk = _module("_disk")
    nan = float("nan")
    rounds = [  # a file written through the page cache reads back fastest; O_DIRECT's slower either way
        {"page cache": (1.0, 1.0), "O_DIRECT": (0.9, 3.0), disk.WRITTEN_DIRECT: (nan, 2.0)},
        {"page cache": (1.0, 1.0), "O_DIRECT": (0.9, 3.0), disk.WRITTEN_DIRECT: (nan, 2.5)},
    ]
    assert disk.faster_way(rounds, 0) == (
        "O_DIRECT",
        [0.9, 0.9],
    )  # the way without a write of its own is not a writer
    assert disk.faster_way(rounds, 1) == ("page cache", [1.0, 1.0])
    assert disk.faster_way(rounds, 1, among=disk.written_as(True)) == (disk.WRITTEN_DIRECT, [2.0, 2.5])
    assert disk.faster_way(rounds, 1, among=disk.written_as(False)) == ("page cache", [1.0, 1.0])
    stall = _module("checkpoint_stall")
    row = {"mb": 100.0, "save_mb_s": 40.0}
    stall.like_for_like(row, rounds, True)
    assert row["like_way"] == disk.WRITTEN_DIRECT and row["like_mb_s"] == 45.0  # the median of 50 and 40 MB/s
    assert abs(row["x_like"] - 40.0 / 45.0) < 1e-12


def test_the_report_sets_each_save_against_the_disk(tmp_path):
    stall = _module("checkpoint_stall")
    out = tmp_path / "stall.json"
    argv = [
        "--width",
        "64",
        "--layers",
        "1",
        "--repeats",
        "1",
        "--steps",
        "2",
        "--no-sharded",
        "--device",
        "cpu",
    ]
    assert stall.main([*argv, "--dir", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["throughput"]
    assert sorted(rows) == ["file_async", "file_resume", "file_sync"]
    for row in rows.values():
        assert row["mb"] == report["config"]["file_mb"] > 0
        assert row["save_mb_s"] > 0 and row["disk_mb_s"] > 0
        assert abs(row["x_disk"] - row["save_mb_s"] / row["disk_mb_s"]) < 1e-9
    assert report["results"]["sync"]["stall_ms_median"] > 0  # the stall report is unchanged
    probes = report["disk_probes_s"]
    assert len(probes) == 1 and all(len(seconds) == 2 for seconds in probes[0].values())
    assert rows["file_sync"]["disk_way"] in probes[0]
    resume = rows["file_resume"]  # a tiny file is written through the page cache: set against such a file
    assert resume["like_way"] in probes[0] and not resume["like_way"].startswith("O_DIRECT")
    assert abs(resume["x_like"] - resume["save_mb_s"] / resume["like_mb_s"]) < 1e-9


def test_size_mb_picks_a_model_of_about_that_size():
    stall = _module("checkpoint_stall")
    for megabytes in (100, 1024, 300, 4096):
        width, layers = stall.sized(megabytes)
        assert abs((width * width + width) * 4 * layers / 1e6 - megabytes) / megabytes < 0.1
    assert stall.sized(1024) == (4096, 15) and stall.sized(100) == (2048, 6)


def test_the_file_io_benchmark_sets_every_way_against_the_disk_and_compares_the_files(tmp_path):
    io_bench = _module("checkpoint_io")
    out = tmp_path / "io.json"
    assert (
        io_bench.main(["--size-mb", "2", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    assert report["identical"], "unison's file differs from torch.save's"
    assert sorted(report["ways"]) == sorted(io_bench.WAYS)
    assert report["ways"]["disk write"]["x_disk"] == report["ways"]["disk read"]["x_disk"] == 1.0
    assert all(w["mb_s"] > 0 and w["cpu_s"] >= 0 for w in report["ways"].values())
    assert [p for p in tmp_path.iterdir() if p.name.startswith("unison-io-")] == [], "its folder was left"


def test_the_simulated_nodes_leave_cold_exactly_the_files_another_rank_checked():
    """benchmarks/sharded_check_share.py: a data file is cold for its loader unless the loader checked it."""
    from unison.checkpoint.sharded_check import share_of

    bench = _module("sharded_check_share")
    names = [".metadata", "rest.pt"] + [f"__{r}_0.distcp" for r in range(4)]
    for world in (2, 4):
        assert bench.cold_for_loader(names, world, share_of) == []  # each rank checks what it loads
        cold = bench.cold_for_loader(names, world, bench.name_order)
        shares = [bench.name_order(names, (k, world)) for k in range(world)]
        expected = [n for n in sorted(names) if n.startswith("__") and n not in shares[int(n[2]) % world]]
        assert cold == expected and cold  # the old shares gave some rank another's file
