"""Every ```python block in the docs (docs/**/*.md, the migration guides in docs/migrating/ too)
and the README runs.

A block that starts with ``# continues the example above`` runs after the block before
it. A block is executed in a fresh namespace in this process; a block with an
``if __name__ == "__main__":`` guard (it spawns ranks, which import it by name) runs as
its own script in a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        if not path.exists():
            continue
        previous = ""
        for i, match in enumerate(_BLOCK.finditer(path.read_text())):
            code = match.group(1)
            if code.startswith("# continues the example above"):
                code = previous + "\n" + code
            found.append((f"{path.relative_to(ROOT)}#{i + 1}", code))
            previous = code
    return found


BLOCKS = _blocks()


def test_docs_have_code() -> None:
    assert len(BLOCKS) >= 5


OPTIONAL_IMPORTS = ("zarr", "torch_geometric", "torchft")
"""Modules of extras a page's example may import: zarr 3 needs Python 3.11 or newer."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_doc_block_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for extra in OPTIONAL_IMPORTS:  # an example of an extra runs where the extra installs
        if re.search(rf"^\s*(import|from) {extra}\b", code, re.MULTILINE):
            pytest.importorskip(extra)
    if "__main__" not in code:
        monkeypatch.chdir(tmp_path)
        exec(compile(code, "<doc block>", "exec"), {"__name__": "doc_block"})
        return
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
