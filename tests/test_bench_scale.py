"""benchmarks/scale.py runs, counts every part at each world size, and draws its figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_scale_benchmark_counts_the_same_collectives_at_two_and_three_ranks(tmp_path):
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--ranks", "2", "3", "--quick"]
    cmd += ["--json", str(out), "--plot", str(png)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["world_size"] for r in report["results"]] == [2, 3]
    for r in report["results"]:
        assert (
            r["collectives_per_iteration"],
            r["collectives_per_sync_point"],
            r["collectives_per_evaluation"],
        ) == (
            0,
            1,
            1,
        )
        assert r["save_bytes_total"] == r["world_size"] * r["save_bytes_per_rank"] > 0
    assert all(t["met"] for t in report["targets"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_refuses_a_world_of_one():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--ranks", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "--ranks must be >= 2" in result.stderr
