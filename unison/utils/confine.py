"""A path from a config kept inside its root, however the code that opens it decodes it.

A store's file given as a path (``logging.mlflow.tracking_uri: mlflow.db``) becomes a URL
(``sqlite:////<root>/mlflow.db``), and the URL's reader percent-decodes it (SQLAlchemy
unquotes the database part): ``%2F..%2F..%2Fx.db`` is a harmless file name to ``pathlib``
and ``/../../x.db`` to SQLite. :func:`confined_path` checks the path as every reader may
see it: percent-encoding decoded until nothing changes, an encoded separator or dot
refused outright, then the decoded path resolved (symbolic links followed) and held inside
the root.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

__all__ = ["ConfinementError", "confined_path"]

_MAX_DECODES = 8  # "%25" nests; a text still changing after this many rounds is refused
_ENCODED = re.compile(r"%(?:2[eEfF]|5[cC]|00)")  # ".", "/", "\" and NUL, encoded
_URL_PARTS = ("?", "#", "\x00")  # a query, a fragment, a NUL: not part of a file's name


class ConfinementError(ValueError):
    """A path that would reach outside its root, or that readers would decode differently."""


def decoded(text: str) -> str:
    """``text`` percent-decoded until it no longer changes.

    Raises:
        ConfinementError: still changing after a few rounds (a nest built to outlast a check).

    Example:
        >>> decoded("runs%252Fmlflow.db")
        'runs/mlflow.db'
    """
    for _ in range(_MAX_DECODES):
        plain = unquote(text)
        if plain == text:
            return text
        text = plain
    raise ConfinementError(f"{text!r} is still percent-encoded after {_MAX_DECODES} decodings")


def confined_path(text: str, root: Path) -> Path:
    """The file ``text`` names, resolved against ``root``, if it stays inside ``root``
    whichever way it is read.

    Refused: an absolute path; percent-encoding of a separator, a dot or NUL at any depth
    (``%2F``, ``%2E``, ``%5C``, ``%252F``...); a ``?``, ``#`` or NUL (a URL would read them as
    its query or fragment); a path that, decoded and resolved (links followed), is outside
    ``root``. Other percent-encoding is checked in its decoded form and kept as written.

    Raises:
        ConfinementError: saying what was found; callers add the key and the fix.

    Example:
        >>> root = Path("/runs")
        >>> str(confined_path("sweeps/mlflow.db", root))
        '/runs/sweeps/mlflow.db'
        >>> confined_path("%2F..%2F..%2Fx.db", root)
        Traceback (most recent call last):
        ...
        unison.utils.confine.ConfinementError: '%2F..%2F..%2Fx.db' holds a percent-encoded '/', '.', '\\' or NUL (%2F): a URL's reader decodes it; write the path plainly
    """
    root = Path(root).resolve()
    plain = decoded(text)
    for layer in {text, *_layers(text)}:
        found = _ENCODED.search(layer)
        if found:
            raise ConfinementError(
                f"{text!r} holds a percent-encoded '/', '.', '\\' or NUL ({found[0]}): a URL's reader "
                "decodes it; write the path plainly"
            )
    for part in _URL_PARTS:
        if part in plain:
            raise ConfinementError(f"{text!r} holds {part!r}, which a URL reads as other than a file name")
    if Path(plain).is_absolute() or Path(text).is_absolute():
        raise ConfinementError(f"{text!r} is an absolute path; a path here is relative to {root}")
    for candidate in {text, plain}:
        if not (root / candidate).resolve().is_relative_to(root):
            raise ConfinementError(f"{text!r} reaches outside {root}")
    return (root / text).resolve()


def _layers(text: str) -> list[str]:
    """Each partial decoding of ``text``: ``%252F`` -> ``%2F`` -> ``/``."""
    out = []
    for _ in range(_MAX_DECODES):
        plain = unquote(text)
        if plain == text:
            break
        out.append(plain)
        text = plain
    return out
