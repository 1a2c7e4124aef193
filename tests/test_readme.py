"""The README's commands stay the ones CI runs and point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_SCRIPT = ROOT / ".ci" / "run"


def section(text: str, heading: str) -> str:
    """The text under a ``## heading``, up to the next heading of level 2 or above."""
    match = re.search(rf"^## {re.escape(heading)}[ \t]*\n(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def commands(script: str) -> list[str]:
    """The lines of a shell script that are not blank or comments."""
    return [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]


def readme_test_command() -> str:
    blocks = bash_blocks(section(README.read_text(), "Run the tests"))
    assert blocks, "the '## Run the tests' section of README.md has no ```bash block"
    lines = commands(blocks[0])
    assert len(lines) == 1, f"the README's test command must be one line, got {lines}"
    return lines[0]


def test_ci_runs_exactly_the_readme_test_command():
    command = readme_test_command()
    ci_lines = commands(CI_SCRIPT.read_text())
    assert command in ci_lines, (
        f".ci/run does not run the README's test command {command!r}; it runs {ci_lines}"
    )
    assert ci_lines[-1] == command, (
        ".ci/run must end with the README's test command, so its exit code is CI's"
    )


def test_ci_script_is_strict_and_executable():
    text = CI_SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in commands(text)
    assert CI_SCRIPT.stat().st_mode & 0o111, ".ci/run is not executable"


def test_readme_commands_name_files_that_exist():
    text = README.read_text()
    paths = set(re.findall(r"\brecipes/[\w/.-]+\.py\b", text))
    assert paths, "the README names no recipe"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"README.md names files that do not exist: {missing}"


def test_torchrun_refuses_nproc_anywhere_as_the_readme_and_launching_guide_say(capsys):
    """torchrun parses its whole command line, the script's arguments included: `--nproc` after
    `unison run` never reaches unison. The README and docs/launching.md quote what it says."""
    import pytest
    from torch.distributed.run import get_args_parser

    with pytest.raises(SystemExit):
        get_args_parser().parse_args(
            ["--nproc-per-node=2", "--no-python", "unison", "run", "c.yaml", "--nproc", "2"]
        )
    said = capsys.readouterr().err.strip().splitlines()[-1]
    quoted = "ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node"
    assert quoted in said, said
    for doc in (README, ROOT / "docs" / "launching.md"):
        assert quoted in " ".join(doc.read_text().split()), doc
    args = get_args_parser().parse_args(["--nproc-per-node=2", "--no-python", "unison", "run", "c.yaml"])
    assert args.training_script_args == ["run", "c.yaml"]  # what the docs say to write instead
