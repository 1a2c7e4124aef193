"""No module of the package is over ~400 lines: small modules, one idea each (STYLE.md)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "unison"
LIMIT = 420
"""Lines a module may have: ~400, with a margin."""

# Modules still over the limit while they are being split (each by its own change). Remove
# an entry once its module is under the limit: the test fails until it is removed.
PENDING: set[str] = set()


def _sizes() -> dict[str, int]:
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_no_module_is_over_the_limit() -> None:
    offenders = [
        f"{name}: {count} lines; split it by idea (STYLE.md, small modules)"
        for name, count in _sizes().items()
        if count > LIMIT and name not in PENDING
    ]
    assert not offenders, f"modules over {LIMIT} lines:\n" + "\n".join(offenders)


def test_pending_modules_are_still_over_the_limit() -> None:
    sizes = _sizes()
    stale = [
        f"{name}: {sizes[name]} lines" if name in sizes else f"{name}: no such module"
        for name in sorted(PENDING)
        if sizes.get(name, 0) <= LIMIT
    ]
    assert not stale, (
        f"modules in PENDING are no longer over {LIMIT} lines; remove them from PENDING in "
        "tests/test_module_size.py:\n" + "\n".join(stale)
    )
