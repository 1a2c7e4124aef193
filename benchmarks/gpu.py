"""On a GPU machine: the CUDA test tier, then every benchmark on the GPU, in one command.

    python benchmarks/gpu.py                 # tests/cuda, then the benchmarks
    python benchmarks/gpu.py --quick         # the same with every benchmark's --quick
    python benchmarks/gpu.py --skip-tests    # the benchmarks only (or --skip-benchmarks)

1. ``pytest tests/cuda -m cuda``: NCCL groups, AMP, DDP and FSDP2, checkpoints, pinned
   loaders, no host sync between sync points, torch.compile (tests needing two GPUs are
   skipped on one).
2. Each script of ``run_all.py`` with ``--device cuda`` (``overhead``, ``ddp``,
   ``metric_sync``, ``sync_point``, ``checkpoint_stall``), and ``compile.py`` where it
   exists, each in its own process; the distributed ones run one NCCL rank per GPU.

Everything goes to ``benchmarks/results/gpu/`` (``--out``): ``tests.txt`` and ``tests.xml``
(pytest's output and junit report), ``report.json`` (the machine, the GPUs, the test counts
and every benchmark's report) and ``summary.md`` (the ratios of medians against the raw
loop and ignite, ready for docs/benchmarks.md). The exit code is 1 when a test or a
benchmark failed. Without a GPU it stops at once, unless ``--allow-cpu`` (which checks the
runner itself: the tier is then skipped and the benchmarks run on the CPU).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _common as C  # noqa: E402
import run_all  # noqa: E402

SCRIPTS = (*run_all.SCRIPTS, "compile")
DEFAULT_OUT = HERE / "results" / "gpu"
TEST_TIMEOUT_S = 1800


def gpu_facts() -> dict[str, Any]:
    """The GPUs as torch and (where present) nvidia-smi see them."""
    import torch

    facts: dict[str, Any] = {
        "cuda_available": torch.cuda.is_available(),
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda": torch.version.cuda,
        "nccl": None,
        "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    }
    if torch.cuda.is_available():
        try:
            version = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError) as err:  # a build without NCCL
            facts["nccl"] = f"unavailable ({err})"
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True)
        facts["nvidia_smi"] = smi.stdout.strip() if smi.returncode == 0 else smi.stderr.strip()
    return facts


def run_tests(out: Path) -> dict[str, Any]:
    """pytest over tests/cuda, its output teed to ``tests.txt``; counts read from its junit report."""
    xml = out / "tests.xml"
    tier = ROOT / "tests" / "cuda"
    cmd = [sys.executable, "-u", "-m", "pytest", str(tier), "-m", "cuda", "-rs", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={xml}"]
    shown = (
        " ".join(["python", *cmd[2:]]).replace(str(tier), "tests/cuda").replace(str(xml), "<out>/tests.xml")
    )
    print(f"\n=== CUDA tier: {shown}", flush=True)
    start = time.perf_counter()
    code, output = run_all._run_teeing(cmd, TEST_TIMEOUT_S)
    (out / "tests.txt").write_text(output)
    result: dict[str, Any] = {
        "status": "timeout" if code is None else "ok" if code == 0 else "failed",
        "returncode": code,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        if suite is not None:
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts = {
                "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
                **counts,
            }
            result["counts"] = counts
            for kind, tags in (("failed", ("failure", "error")), ("skipped", ("skipped",))):
                result[kind] = [
                    f"{case.get('classname')}::{case.get('name')}: {child.get('message', child.tag)}"
                    for case in suite.iter("testcase")
                    for child in case
                    if child.tag in tags
                ]
    return result


# -- the summary: ratios of medians against the raw loop and ignite ----------------------------


def _ratio(value: Any) -> str:
    return "" if value is None else f"{value:.3f}"


def summary_rows(name: str, report: dict[str, Any]) -> list[list[str]]:
    """[benchmark, what, value, x raw, x ignite] rows of one script's report (its key ratios)."""
    rows: list[list[str]] = []
    if name == "overhead":
        for workload in report.get("workloads", []):
            for variant, r in workload["results"].items():
                if variant == "raw":
                    continue
                rows.append(
                    [
                        f"overhead/{workload['workload']}",
                        f"{variant}: median iteration",
                        f"{r['iteration_median_us_per_iter']:.1f} us",
                        _ratio(r["iteration_ratio_to_raw"]),
                        _ratio(r["iteration_ratio_to_ignite"]),
                    ]
                )
    elif name == "ddp":
        config = report.get("config", {})
        for variant, r in report.get("throughput", {}).get("results", {}).items():
            if variant != "raw":
                rows.append(
                    [
                        f"ddp ({config.get('nproc')} {config.get('backend')} rank(s))",
                        f"{variant}: median iteration / epoch",
                        f"{r['median_iteration_ms']:.3f} ms / {r['median_epoch_s']:.3f} s",
                        f"{r['iteration_ratio_to_raw']:.3f} / {r['ratio_to_raw']:.3f}",
                        "",
                    ]
                )
        startup = report.get("startup", {}).get("median_s", {})
        if startup:
            key = "launch_to_first_iteration"
            rows.append(
                [
                    "ddp start-up",
                    "launch to first iteration (raw, unison)",
                    f"{startup['raw'][key]:.2f} s, {startup['unison'][key]:.2f} s",
                    _ratio(startup["unison"][key] / startup["raw"][key]),
                    "",
                ]
            )
    elif name == "metric_sync":
        for size, e in report.get("evaluations", {}).items():
            r = e["results"]["unison"]
            rows.append(
                [
                    f"metric_sync/{size}",
                    "unison: collectives, ms per evaluation",
                    f"{r['collectives_per_evaluation']:g}, {r['median_ms_per_evaluation']:.2f} ms",
                    "",
                    _ratio(r["ratio_to_ignite"]),
                ]
            )
    elif name == "sync_point":
        share = report.get("share_of_step", {}).get("100", report.get("share_of_step", {}).get(100))
        if share:
            rows.append(
                [
                    "sync_point",
                    "share of an MLP step at sync_every=100 (isolated)",
                    f"{share['isolated_percent']:.3f}%",
                    "",
                    "",
                ]
            )
    elif name == "checkpoint_stall":
        results = report.get("results", {})
        if "sync" in results and "async" in results:
            rows.append(
                [
                    "checkpoint_stall",
                    "stall, sync / async",
                    f"{results['sync']['stall_ms_median']:.1f} ms / {results['async']['stall_ms_median']:.1f} ms",
                    f"async x sync {report['async_over_sync_stall']:.3f}",
                    "",
                ]
            )
    return rows


def write_summary(out: Path, report: dict[str, Any]) -> str:
    facts = report["gpu"]
    lines = [
        f"# unison on {', '.join(facts['gpu_names']) or 'the CPU (no GPU)'}, {report['date']}",
        "",
        f"GPUs: {', '.join(facts['gpu_names']) or 'none'}; CUDA {facts['cuda']}, NCCL {facts['nccl']}; "
        f"torch {report['torch']}, ignite {report['ignite']}, unison {report['unison']}; {report['machine']}.",
        "",
    ]
    tests = report.get("tests")
    if tests:
        counts = tests.get("counts", {})
        lines += [
            f"CUDA tier (`pytest tests/cuda -m cuda`): {tests['status']}, "
            + ", ".join(f"{v} {k}" for k, v in counts.items() if k != "tests")
            + f", {tests['seconds']:.0f} s.",
            "",
        ]
        lines += [f"- failed: {entry}" for entry in tests.get("failed", [])]
        lines += [""] if tests.get("failed") else []
    rows = []
    for name, entry in report.get("benchmarks", {}).items():
        if entry.get("status") != "ok":
            rows.append([name, entry.get("status", "?"), "", "", ""])
            continue
        rows += summary_rows(name, entry.get("report", {})) or [[name, "ok (see report.json)", "", "", ""]]
    if rows:
        lines += [
            "| benchmark | what (medians) | value | x raw | x ignite |",
            "|---|---|---|---|---|",
            *(f"| {' | '.join(row)} |" for row in rows),
            "",
        ]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--skip-tests", action="store_true", help="run the benchmarks only")
    parser.add_argument("--skip-benchmarks", action="store_true", help="run the CUDA tier only")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, default=None, help="run these benchmarks only")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT.relative_to(ROOT)}"
    )
    parser.add_argument(
        "--timeout", type=float, default=1200, help="seconds per benchmark before it is stopped"
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run without a GPU (checks the runner: benchmarks on the CPU)",
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "benchmarks/gpu.py: torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda}). Run it on a GPU machine, in an "
            "environment with a CUDA build of torch; --allow-cpu runs it anyway, on the CPU.",
            file=sys.stderr,
        )
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "suite": "unison on a GPU",
        "mode": "quick" if args.quick else "full",
        **C.environment(torch.device(device)),
        "gpu": gpu_facts(),
    }
    C.print_environment(report)
    print(f"GPUs: {report['gpu']['gpu_names'] or 'none'}")
    started = time.perf_counter()
    failed = False
    if not args.skip_tests:
        report["tests"] = run_tests(out)
        failed |= report["tests"]["status"] != "ok"
    if not args.skip_benchmarks:
        report["benchmarks"] = {}
        with tempfile.TemporaryDirectory(prefix="unison-gpu-bench-") as tmp:
            for name in args.only or SCRIPTS:
                entry = run_all.run_one(name, args.quick, device, args.timeout, Path(tmp))
                report["benchmarks"][name] = entry
                failed |= entry["status"] in ("failed", "timeout")
    report["seconds"] = round(time.perf_counter() - started, 1)
    C.write_json(out / "report.json", report)
    print("\n=== summary\n" + write_summary(out, report))
    print(f"wrote {out / 'summary.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
