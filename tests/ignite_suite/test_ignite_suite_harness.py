"""The harness that runs ignite's tests: its pin, its extraction, its reading of junitxml and
its verdict, on small inputs made here (seconds, no download)."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import ignite_sdist
import pytest
from not_applicable import NOT_APPLICABLE, NOT_RUN
from run_ignite_suite import INI, Outcome, Selection, SuiteRun, judge, parse_junit


def test_a_cached_sdist_that_differs_from_the_pin_is_refused_naming_both_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNISON_IGNITE_SUITE_CACHE", str(tmp_path))
    (tmp_path / ignite_sdist.SDIST_NAME).write_bytes(b"not ignite")
    with pytest.raises(ignite_sdist.SuiteFetchError) as caught:
        ignite_sdist.fetch_sdist()
    actual = ignite_sdist.sha256_of(tmp_path / ignite_sdist.SDIST_NAME)
    assert ignite_sdist.SDIST_SHA256 in str(caught.value) and actual in str(caught.value)


def _archive(path: Path, members: dict[str, bytes | None], link: str | None = None) -> Path:
    top = f"pytorch_ignite-{ignite_sdist.IGNITE_VERSION}"
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            if data is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(f"{top}/{link}")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            archive.addfile(info)
    return path


def test_only_tests_is_taken_from_the_sdist(tmp_path: Path) -> None:
    sdist = _archive(
        tmp_path / "a.tar.gz",
        {"tests": None, "tests/ignite/test_x.py": b"x = 1\n", "ignite/engine.py": b"", "setup.py": b""},
    )
    with tarfile.open(sdist) as archive:
        names = [m.name for m in ignite_sdist._tests_members(archive, tmp_path / "out")]
    assert names == ["tests", "tests/ignite/test_x.py"]


@pytest.mark.parametrize(
    ("members", "link", "message"),
    [
        ({"tests/ignite/../../../escape.py": b""}, None, "unsafe path"),
        ({"tests/ignite/ok.py": b""}, "tests/ignite/link.py", "not a plain file"),
        ({"tests/other/ok.py": b""}, None, "no tests/ignite/"),
    ],
)
def test_an_sdist_with_paths_that_escape_links_or_no_tests_is_refused(
    tmp_path: Path, members: dict[str, bytes | None], link: str | None, message: str
) -> None:
    sdist = _archive(tmp_path / "a.tar.gz", members, link)
    with tarfile.open(sdist) as archive, pytest.raises(ignite_sdist.SuiteFetchError, match=message):
        ignite_sdist._tests_members(archive, tmp_path / "out")


def test_junitxml_gives_back_pytests_own_node_ids_and_outcomes(tmp_path: Path) -> None:
    """A small suite run by a real pytest with the harness's ini and options: what the harness
    reads from its junitxml matches what that pytest itself reports with ``-rA``."""
    pkg = tmp_path / "tests" / "ignite"
    pkg.mkdir(parents=True)
    for folder in (tmp_path / "tests", pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import pytest

            class TestGroup:
                @pytest.mark.parametrize("value", [1, 2])
                def test_param(self, value):
                    assert value == 1

            def test_skipped():
                pytest.skip("no GPU")

            @pytest.fixture
            def broken():
                raise RuntimeError("fixture broke")

            def test_error_in_setup(broken):
                pass
            """
        )
    )
    (pkg / "test_unimportable.py").write_text("import not_a_module_anywhere\n")
    junit = tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-c", str(INI), f"--rootdir={tmp_path}", "-p", "no:cacheprovider"]
    cmd.append("--continue-on-collection-errors")  # as run_ignite_suite.command()
    proc = subprocess.run(
        [*cmd, "-rA", "-q", f"--junitxml={junit}", "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    outcomes = {nodeid: result.outcome for nodeid, result in parse_junit(junit).items()}
    assert outcomes == {
        "tests/ignite/test_sample.py::TestGroup::test_param[1]": "passed",
        "tests/ignite/test_sample.py::TestGroup::test_param[2]": "failed",
        "tests/ignite/test_sample.py::test_skipped": "skipped",
        "tests/ignite/test_sample.py::test_error_in_setup": "failed",
        "tests/ignite/test_unimportable.py": "failed",
    }, proc.stdout
    for nodeid, outcome in outcomes.items():  # the ids of pytest's own summary lines (-rA)
        assert outcome == "skipped" or nodeid in proc.stdout, nodeid


def _run_with(outcomes: dict[str, str], deselected: frozenset[str] = frozenset()) -> SuiteRun:
    selection = Selection("t", ("tests/ignite/engine",), "", distributed=False, timeout_s=1)
    results = {nodeid: Outcome(nodeid, outcome) for nodeid, outcome in outcomes.items()}
    return SuiteRun(selection, "unison", 1, 0.0, results, set(deselected), "")


def test_the_verdict_names_failures_entries_that_pass_now_and_entries_that_name_nothing() -> None:
    not_applicable = {
        "tests/ignite/engine/test_a.py::test_refused": "deliberate",
        "tests/ignite/engine/test_a.py::test_fixed": "was deliberate",
        "tests/ignite/engine/test_a.py::test_renamed": "gone",
        "tests/ignite/engine/test_a.py::test_distrib": "left out by -m here",
        "tests/ignite/engine/test_a.py::test_slow": "not run",
        "tests/ignite/handlers/test_b.py::test_other": "another selection's",
    }
    run = _run_with(
        {
            "tests/ignite/engine/test_a.py::test_ok": "passed",
            "tests/ignite/engine/test_a.py::test_broken": "failed",
            "tests/ignite/engine/test_a.py::test_refused": "failed",
            "tests/ignite/engine/test_a.py::test_fixed": "passed",
        },
        deselected=frozenset({"tests/ignite/engine/test_a.py::test_distrib"}),
    )
    problems = judge(run, not_applicable, {"tests/ignite/engine/test_a.py::test_slow"})
    assert [p.split(":", 1)[0] for p in problems] == [
        "FAILED tests/ignite/engine/test_a.py",
        "PASSES NOW tests/ignite/engine/test_a.py",
        "NOT FOUND tests/ignite/engine/test_a.py",
    ]
    assert "test_broken" in problems[0] and "test_fixed" in problems[1] and "test_renamed" in problems[2]


def test_not_applicable_is_well_formed() -> None:
    assert NOT_RUN <= NOT_APPLICABLE.keys()
    for key, reason in NOT_APPLICABLE.items():
        assert key.startswith("tests/ignite/") and key.split("::", 1)[0].endswith(".py"), key
        assert reason.strip(), f"{key} has no reason"
