"""Runs a selection of ignite's own tests in a pytest of its own, with unison's Engine in
place of ignite's (or ignite's own, for comparison), and judges the result.

From the repository root::

    python tests/ignite_suite/run_ignite_suite.py                 # engine + handlers, unison's Engine
    python tests/ignite_suite/run_ignite_suite.py --plain         # the same with ignite's own Engine
    python tests/ignite_suite/run_ignite_suite.py --selection distributed   # 2 gloo ranks
    python tests/ignite_suite/run_ignite_suite.py --selection metrics       # 2 ranks, slow

It prints each failing test and the counts, and exits 1 when the run breaks the rules of
``not_applicable.py`` (tests/ignite_suite/test_ignite_suite.py applies the same rules).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE, HERE.parent):  # this folder (the plugins) and tests/ (_procs) when run as a script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from ignite_sdist import cache_dir, extracted_suite  # noqa: E402
from not_applicable import NOT_APPLICABLE, NOT_RUN  # noqa: E402

INI = HERE / "ignite-pytest.ini"
METRICS_MARK = "ignite_metrics"
"""Our mark of the distributed metric run (minutes), deselected unless ``-m`` names it (conftest.py)."""
SUMMARY_KEY = "ignite_suite"
"""``record_property`` name of a run's summary line, which conftest.py prints in the summary."""
RANKS = 2
_NOT_DISTRIBUTED = "not distributed and not tpu and not multinode_distributed"
# The variables of a launcher or of the pytest running this one: the child starts clean.
_DROPPED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "UNISON_SPAWNED")
_DROPPED_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PYTEST_")


@dataclass(frozen=True)
class Selection:
    """Which of ignite's tests one run takes: paths (under ignite's ``tests/``) and a mark expression."""

    name: str
    paths: tuple[str, ...]
    markexpr: str
    distributed: bool
    timeout_s: float

    def covers(self, nodeid: str) -> bool:
        path = nodeid.split("::", 1)[0]
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.paths)


SELECTIONS = {
    "engine": Selection(
        "engine",
        (
            "tests/ignite/engine",
            "tests/ignite/handlers/test_early_stopping.py",
            "tests/ignite/handlers/test_terminate_on_nan.py",
            "tests/ignite/handlers/test_checkpoint.py",
        ),
        _NOT_DISTRIBUTED,
        distributed=False,
        timeout_s=900,
    ),
    "distributed": Selection(
        "distributed",
        ("tests/ignite/engine", "tests/ignite/handlers", "tests/ignite/contrib/engines"),
        "distributed",
        distributed=True,
        timeout_s=900,
    ),
    "metrics": Selection(
        "metrics", ("tests/ignite/metrics",), "distributed", distributed=True, timeout_s=3600
    ),
}


@dataclass
class Outcome:
    """One test's result; under xdist's ``--dist=each`` a test has one per rank, the worst kept."""

    nodeid: str
    outcome: str  # "passed", "skipped" or "failed" (a failure or an error, at any phase)
    message: str = ""
    where: str = ""  # the last "file:line" of the traceback
    seconds: float = 0.0


_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}


@dataclass
class SuiteRun:
    selection: Selection
    engine: str  # "unison" or "ignite"
    returncode: int
    seconds: float
    outcomes: dict[str, Outcome]
    deselected: set[str]
    output: str
    junit: Path | None = None
    problems: list[str] = field(default_factory=list)

    def with_outcome(self, outcome: str) -> list[Outcome]:
        return [o for o in self.outcomes.values() if o.outcome == outcome]

    def counts(self) -> dict[str, int]:
        counts = {name: len(self.with_outcome(name)) for name in _SEVERITY}
        counts["collected"] = len(self.outcomes)
        return counts

    def summary_line(self) -> str:
        c = self.counts()
        listed = sum(1 for r in self.with_outcome("failed") if r.nodeid in NOT_APPLICABLE)
        return (
            f"ignite {self.selection.name} tests with {self.engine}'s Engine: {c['passed']} passed, "
            f"{c['failed'] - listed} failed, {listed} not applicable (failing as listed), "
            f"{c['skipped']} skipped of {c['collected']} ({self.seconds:.0f} s)"
        )


def _nodeid(case: ET.Element) -> str:
    """A test's pytest node id from junitxml (xunit1: the ``file`` attribute)."""
    name, classname, file = case.get("name", ""), case.get("classname", ""), case.get("file")
    if not file:  # a collection error: its name is the module
        return classname.replace(".", "/") + "::" + name if classname else name
    module = file[: -len(".py")].replace("/", ".") if file.endswith(".py") else file
    if name == module:  # a module that failed to import
        return file
    inner = classname[len(module) :].lstrip(".").split(".") if classname.startswith(module) else []
    return "::".join([file, *[part for part in inner if part], name])


def _where(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    located = [line for line in lines if ".py:" in line and not line.startswith("E ")]
    return located[-1] if located else ""


def parse_junit(path: Path) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        nodeid = _nodeid(case)
        result = Outcome(nodeid, "passed", seconds=float(case.get("time") or 0))
        for child in case:
            if child.tag in ("failure", "error"):
                result.outcome = "failed"
                message = (child.get("message") or "").strip()
                head = [line.strip() for line in message.splitlines() if line.strip()][:3]
                result.message = " | ".join(head)[:400] if head else child.tag
                result.where = _where(child.text or "")
                break
            if child.tag == "skipped" and result.outcome == "passed":
                result.outcome, result.message = "skipped", (child.get("message") or "")[:200]
        known = outcomes.get(nodeid)
        if known is None or _SEVERITY[result.outcome] > _SEVERITY[known.outcome]:
            if known is not None:
                result.seconds = max(result.seconds, known.seconds)
            outcomes[nodeid] = result
    return outcomes


def child_env(run_dir: Path, distributed: bool) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _DROPPED_VARS and not key.startswith(_DROPPED_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env["UNISON_IGNITE_RUN_DIR"] = str(run_dir)
    env["OMP_NUM_THREADS"] = "1"  # tiny models: more threads only fight on a small machine
    env["CUDA_VISIBLE_DEVICES"] = ""  # the same tests on every machine: the GPU ones skip
    if distributed:
        env["WORLD_SIZE"] = str(RANKS)
    return env


def command(selection: Selection, unison: bool, junit: Path, suite: Path) -> list[str]:
    """The child's pytest command line; it runs in ``suite``, the folder holding ignite's ``tests/``."""
    cmd = [
        sys.executable, "-m", "pytest", "-c", str(INI), f"--rootdir={suite}", "-p", "no:cacheprovider",
        "-p", "no:zarr", "-p", "no:anyio",  # plugins of installed packages that ignite's tests do not use
        "-p", "ignite_run_plugin", "-m", selection.markexpr,
        "-q", "-rfE", "--tb=short", "--color=no", f"--junitxml={junit}",
        "--continue-on-collection-errors",  # a module that cannot be imported fails alone
    ]  # fmt: skip
    if unison:
        cmd += ["-p", "unison_ignite_plugin"]
    if selection.distributed:  # one xdist worker per rank, every test on each (as ignite's CI)
        cmd += ["--dist=each", f"--tx={RANKS}*popen//python={sys.executable}"]
    cmd += list(selection.paths)
    for key in sorted(NOT_APPLICABLE):
        if not selection.covers(key):
            continue
        if "::" not in key:
            cmd += ["--ignore", key]
        elif key in NOT_RUN:
            cmd += ["--deselect", key]
    return cmd


def _run(cmd: list[str], cwd: Path, env: Mapping[str, str], timeout_s: float) -> tuple[int, str]:
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        from _procs import kill_tree

        kill_tree(proc)  # this run's session and everything below it, nothing else
        out, _ = proc.communicate()
        raise TimeoutError(
            f"ignite's tests did not finish in {timeout_s:g} s: {' '.join(cmd)}\n{out[-4000:]}"
        ) from None
    return proc.returncode, out


def run_suite(selection: Selection, *, unison: bool = True, keep_junit: bool = True) -> SuiteRun:
    """Runs ``selection`` in a child pytest and judges it (``SuiteRun.problems``)."""
    suite = extracted_suite()
    engine = "unison" if unison else "ignite"
    with tempfile.TemporaryDirectory(prefix="ignite-run-") as tmp:
        run_dir = Path(tmp)
        junit = run_dir / "junit.xml"
        start = time.monotonic()
        rc, out = _run(
            command(selection, unison, junit, suite),
            suite,
            child_env(run_dir, selection.distributed),
            selection.timeout_s,
        )
        seconds = time.monotonic() - start
        outcomes = parse_junit(junit) if junit.exists() else {}
        deselected = {
            line
            for path in run_dir.glob("deselected-*.txt")
            for line in path.read_text().splitlines()
            if line
        }
        kept = None
        if keep_junit and junit.exists():  # the last run of each kind, for a look afterwards
            results = cache_dir() / "results"
            results.mkdir(parents=True, exist_ok=True)
            kept = results / f"{selection.name}-{engine}.xml"
            shutil.copyfile(junit, kept)
    run = SuiteRun(selection, engine, rc, seconds, outcomes, deselected, out, kept)
    run.problems = judge(run) if unison else _environment_problems(run)
    if kept is not None:
        kept.with_suffix(".json").write_text(
            json.dumps({**run.counts(), "seconds": round(seconds, 1)}) + "\n"
        )
    return run


def _environment_problems(run: SuiteRun) -> list[str]:
    problems = []
    if run.returncode not in (0, 1) or not run.outcomes:
        problems.append(
            f"pytest ended with exit code {run.returncode} and {len(run.outcomes)} results:\n{run.output[-3000:]}"
        )
    return problems


def judge(
    run: SuiteRun, not_applicable: Mapping[str, str] = NOT_APPLICABLE, not_run: Collection[str] = NOT_RUN
) -> list[str]:
    """Every collected test passes or skips, but those of ``not_applicable``; and each entry of it
    that this run covers still names a test that does not pass."""
    problems = _environment_problems(run)
    for result in sorted(run.with_outcome("failed"), key=lambda r: r.nodeid):
        if result.nodeid not in not_applicable:
            problems.append(f"FAILED {result.nodeid}: {result.message} [{result.where}]")
    for nodeid in sorted(not_applicable):
        if "::" not in nodeid or nodeid in not_run or not run.selection.covers(nodeid):
            continue
        result = run.outcomes.get(nodeid)
        if result is not None and result.outcome == "passed":
            problems.append(
                f"PASSES NOW {nodeid}: remove it from NOT_APPLICABLE (tests/ignite_suite/not_applicable.py)"
            )
        elif result is None and nodeid not in run.deselected:
            problems.append(f"NOT FOUND {nodeid}: NOT_APPLICABLE names a test that is not collected any more")
    return problems


def report(run: SuiteRun) -> str:
    lines = [run.summary_line()]
    for result in sorted(run.with_outcome("failed"), key=lambda r: r.nodeid):
        tag = "  (not applicable)" if result.nodeid in NOT_APPLICABLE else ""
        lines.append(f"  failed: {result.nodeid}{tag}\n      {result.message}\n      at {result.where}")
    lines += [f"  problem: {p}" for p in run.problems if not p.startswith("FAILED ")]
    if run.junit is not None:
        lines.append(f"  junitxml: {run.junit}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--selection", choices=sorted(SELECTIONS), default="engine")
    parser.add_argument("--plain", action="store_true", help="ignite's own Engine (no swap), for comparison")
    args = parser.parse_args(argv)
    run = run_suite(SELECTIONS[args.selection], unison=not args.plain)
    print(report(run))
    return 1 if run.problems else 0


if __name__ == "__main__":
    sys.exit(main())
