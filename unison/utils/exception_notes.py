"""Adding context to an exception on its way up, on every supported Python."""

from __future__ import annotations

import sys
import traceback
from typing import Any


def add_note(err: BaseException, note: str) -> None:
    """Adds ``note`` to ``err`` (``BaseException.add_note`` on 3.11+, the same attribute on 3.10).

    Example:
        >>> err = ValueError("bad")
        >>> add_note(err, "while loading x.yaml")
        >>> err.__notes__
        ['while loading x.yaml']
    """
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:  # Python 3.10: keep the note where the 3.11 machinery prints it from
        notes = [*getattr(err, "__notes__", []), note]
        setattr(err, "__notes__", notes)  # noqa: B010  # 3.10's BaseException declares no __notes__


def has_note(err: BaseException, note: str | None = None) -> bool:
    """Whether ``err`` carries any note (or this ``note``)."""
    notes = getattr(err, "__notes__", None) or []
    return bool(notes) if note is None else note in notes


def format_exception(err: BaseException) -> str:
    """``err``'s traceback as Python prints it, notes included on every supported Python.

    Python 3.10 prints no ``__notes__``: there they follow the traceback, one line each, for
    every exception of the chain that carries them.

    Example:
        >>> err = ValueError("bad")
        >>> add_note(err, "raised by handler h")
        >>> format_exception(err).splitlines()[-1]
        'raised by handler h'
    """
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return text if sys.version_info >= (3, 11) else text + _chain_notes(err)


def _chain_notes(err: BaseException) -> str:
    """The notes of ``err`` and of the exceptions it was raised from, oldest first, a line each."""
    notes: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        notes = [*getattr(current, "__notes__", []), *notes]
        current = current.__cause__ or current.__context__
    return "".join(f"{note}\n" for note in notes)


def print_notes_at_exit() -> None:
    """On Python 3.10, an uncaught exception prints its notes too, after the traceback that the
    hook in place prints (Python's own, or the one torch.distributed installs); 3.11 does it itself."""
    previous = sys.excepthook
    if sys.version_info >= (3, 11) or getattr(previous, "prints_notes", False):
        return

    def hook(kind: type[BaseException], err: BaseException, tb: Any) -> None:
        previous(kind, err, tb)
        sys.stderr.write(_chain_notes(err))

    hook.prints_notes = True  # type: ignore[attr-defined]
    sys.excepthook = hook
