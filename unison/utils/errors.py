"""Adding context to an exception on its way up, on every supported Python."""

from __future__ import annotations


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
