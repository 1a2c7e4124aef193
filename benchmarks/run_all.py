"""Runs every benchmark, one after the other, and collects their reports in one JSON file.

Each script runs in its own process (they spawn ranks and set torch's thread count), with
``--json`` pointed at a temporary file; ``--quick`` and ``--device`` are passed on to the
scripts that take them. The collected report (environment, mode, and each script's
report, return code and duration) goes to ``benchmarks/results/latest.json`` unless
``--out`` says otherwise. A script that fails is recorded with the tail of its output and
the others still run; the exit code is then 1.

    python benchmarks/run_all.py --quick               # smoke run of the whole suite, ~3-4 minutes
    python benchmarks/run_all.py                       # full run, ~8-10 minutes on 2 busy cores
    python benchmarks/run_all.py --only overhead ddp   # a subset, updated in the existing file
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402

SCRIPTS = ("overhead", "ddp", "fsdp", "metric_sync", "sync_point", "checkpoint_stall", "stream_loading")
DEFAULT_OUT = HERE / "results" / "latest.json"


def _flags(script: Path) -> set[str]:
    """Which of the common flags a script takes, read from its source (not from --help,
    which a help string with a bare % breaks)."""
    text = script.read_text()
    common = {"--json", "--quick", "--device", "--amp", "--repeats"}
    if "add_common_args(" in text:
        return common
    return {flag for flag in common if f'"{flag}"' in text or f"'{flag}'" in text}


def _run_teeing(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Runs ``cmd``, printing its output as it comes; (return code or None on timeout, output)."""
    lines: list[str] = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
    )

    def tee() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)

    reader = threading.Thread(target=tee, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the ranks it spawned (its own session)
        proc.wait()
        code = None
    reader.join(timeout=10)
    return code, "".join(lines)


def run_one(name: str, quick: bool, device: str | None, timeout: float, tmp: Path) -> dict[str, Any]:
    script = HERE / f"{name}.py"
    if not script.exists():
        return {"status": "absent"}
    flags = _flags(script)
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-u", str(script)]
    if "--json" in flags:
        cmd += ["--json", str(out)]
    if quick and "--quick" in flags:
        cmd.append("--quick")
    if device and "--device" in flags:
        cmd += ["--device", device]
    shown = " ".join(["python", f"benchmarks/{name}.py", *cmd[3:]]).replace(str(out), "<json>")
    print(f"\n=== {name}: {shown}", flush=True)
    start = time.perf_counter()
    code, output = _run_teeing(cmd, timeout)
    entry: dict[str, Any] = {
        "status": "timeout" if code is None else "ok" if code == 0 else "failed",
        "returncode": code,
        "seconds": round(time.perf_counter() - start, 1),
        "command": shown,
    }
    if code == 0 and out.exists():
        entry["report"] = json.loads(out.read_text())
    else:
        entry["output_tail"] = output[-4000:]
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="pass --device to every script"
    )
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, default=None, help="run these scripts only")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT.relative_to(HERE.parent)}"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per script before it is stopped")
    args = parser.parse_args(argv)

    import torch

    device = C.resolve_device(args.device)
    report: dict[str, Any] = {
        "suite": "unison benchmarks",
        "mode": "quick" if args.quick else "full",
        **C.environment(torch.device(device)),
        "benchmarks": {},
    }
    C.print_environment(report)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="unison-bench-") as tmp:
        for name in args.only or SCRIPTS:
            report["benchmarks"][name] = run_one(name, args.quick, args.device, args.timeout, Path(tmp))
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.only and args.out.exists():
        # a subset updates its entries in the existing file; each report keeps its own date
        previous = json.loads(args.out.read_text())
        merged = {**previous.get("benchmarks", {}), **report["benchmarks"]}
        report["benchmarks"] = {name: merged[name] for name in SCRIPTS if name in merged}
        report["updated"] = sorted(args.only)

    print("\n=== summary")
    failed = False
    for name, entry in report["benchmarks"].items():
        status = entry["status"]
        failed |= status in ("failed", "timeout")
        line = f"{name:<17} {status:<8} {entry.get('seconds', 0):>6.0f} s"
        targets = entry.get("report", {}).get("targets", [])
        for target in targets if isinstance(targets, list) else []:
            if isinstance(target, dict) and "met" in target:
                met = target["met"]  # None: the run cannot judge it (one rank, say)
                line += f"\n    {C.verdict(None if met is None else bool(met))}: {target.get('target')}"
        print(line)
    C.write_json(args.out, report)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
