"""Credentials out of everything a run writes or prints: URLs with their passwords masked.

A store's URL (``logging.mlflow.tracking_uri``, ``tuning.storage``) may carry a password:
``postgresql://user:PASSWORD@host/db``. The code that opens the store uses the URL as
written; every copy of it that leaves the process (a saved config, an MLflow parameter or
tag, a record file, a log line, a summary, an error message) goes through :func:`redact`
first. What is masked, with :data:`MASK`:

- the password of a URL's user information: ``scheme://user:PASSWORD@host``, and
  ``scheme://:PASSWORD@host``; it may hold any character (quotes, spaces, "@", "/", ":") and
  runs to the last "@" of its line; the user, the host, the port and the path stay, for
  diagnosis;
- for web URLs (``http``, ``https``, ``ws``, ``wss``, ``ftp``, ``git+https``...), a user
  information without a password too: ``https://TOKEN@host`` is how those carry a token;
- the value of a query or fragment parameter whose name says it holds a secret
  (``?password=``, ``token=``, ``#access_token=``, ``api_key=``, ``secret=``, ``sig=``...),
  in any text;
- ``NAME=VALUE`` after a space or at the start, for a name ending in ``password``, ``pwd``,
  ``passphrase``, ``secret`` or ``token``: libpq's keyword strings
  (``host=db password='a b' dbname=runs``), a quoted value whole.

Nothing is looked up in the environment and nothing is interpolated: a password kept out of
the config (``MLFLOW_TRACKING_PASSWORD``, ``PGPASSWORD``) never reaches these strings at all.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["MASK", "RedactingFilter", "redact", "redact_url"]

MASK = "***"
"""What a masked secret reads as."""

_T = TypeVar("_T")

# scheme://user[:password]@ . The user stops at the first ":" "/" "?" "#" "@" or space. The
# password runs to the LAST "@" of the line: RFC 3986 lets a password hold "'" and the
# sub-delimiters as written, people write "@", "/", ":", quotes and spaces in it anyway, and a
# text cannot tell such a password from a later "@" on its line; masking errs toward hiding.
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)"
    r"(?P<user>[^\s:/?#@\"<>]*)"
    r"(?::(?P<password>[^\r\n]*))?"
    r"@"
)
_SECRET_NAME = (
    r"[\w.\-]*(?:password|passwd|pwd|passphrase|secret|token|api[_-]?key|apikey|access[_-]?key"
    r"|credential|signature)[\w.\-]*"
)
# ?name=value, &name=value, ;name=value, #name=value: the value runs to the next "&" ";" "#",
# or to a character a URL cannot hold as written (a space, '"', "<", ">").
_SECRET_PARAM = re.compile(
    rf"(?P<name>(?<=[?&;#])(?:sig|{_SECRET_NAME})=)(?P<value>[^&;#\s\"<>]+)",
    re.IGNORECASE,
)
# libpq's keyword strings (``host=db password='a b' dbname=runs``) and ``name=value`` in any
# text: spaces around "=", a value in single quotes (with \' and \\ inside) or up to a space.
_KEYWORD = re.compile(
    r"(?P<name>(?:^|(?<=[\s\"',(\[{]))[\w.\-]*(?:password|passwd|pwd|passphrase|secret|token)[ \t]*=[ \t]*)"
    r"(?P<value>'(?:[^'\\\r\n]|\\.)*'?|[^\s'][^\s]*)",
    re.IGNORECASE,
)
_WEB = ("http", "https", "ws", "wss", "ftp", "ftps")


def _userinfo(match: re.Match[str]) -> str:
    scheme, user, password = match["scheme"], match["user"], match["password"]
    if password is not None:
        return f"{scheme}{user}:{MASK}@"
    base = scheme[:-3].lower().rsplit("+", 1)[-1]
    if user and base in _WEB:  # https://TOKEN@host
        return f"{scheme}{MASK}@"
    return match[0]


def redact_url(text: str) -> str:
    """``text`` with the credentials of every URL in it masked (see the module's notes); the
    rest kept as it is. Works on a URL alone or on any text holding URLs.

    Example:
        >>> redact_url("postgresql://mlflow:s3cret@db.example.org:5432/runs")
        'postgresql://mlflow:***@db.example.org:5432/runs'
        >>> redact_url("could not open redis://:hunter2@cache:6379/0")
        'could not open redis://:***@cache:6379/0'
        >>> redact_url("https://ghp_abc123@git.example.org/x.git")
        'https://***@git.example.org/x.git'
        >>> redact_url("mysql://u@h/db?ssl=true&password=pw")
        'mysql://u@h/db?ssl=true&password=***'
        >>> redact_url("host=db password='my secret' dbname=runs")
        'host=db password=*** dbname=runs'
        >>> redact_url("sqlite:////runs/mlflow.db")
        'sqlite:////runs/mlflow.db'
    """
    if "@" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text:
        text = _KEYWORD.sub(lambda m: m["name"] + MASK, text)
        text = _SECRET_PARAM.sub(lambda m: m["name"] + MASK, text)
    return text


def redact(obj: _T) -> _T:
    """A copy of ``obj`` with :func:`redact_url` applied to every string in it, walking
    mappings (values only), lists and tuples; anything else is returned as it is.

    Example:
        >>> redact({"tuning": {"storage": "postgresql://u:pw@h/db"}, "lr": 0.1, "tags": ["a"]})
        {'tuning': {'storage': 'postgresql://u:***@h/db'}, 'lr': 0.1, 'tags': ['a']}
    """
    out: Any
    if isinstance(obj, str):
        out = redact_url(obj)
    elif isinstance(obj, Mapping):
        out = {k: redact(v) for k, v in obj.items()}
    elif isinstance(obj, list):
        out = [redact(v) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        out = tuple(redact(v) for v in obj)
    else:
        out = obj
    return out


class RedactingFilter(logging.Filter):
    """A logging filter for a handler: each record's message and traceback go out with
    :func:`redact_url` applied. unison's console handler (:func:`~unison.utils.setup_logging`)
    and a run's log files carry it.

    Example:
        >>> import logging
        >>> record = logging.LogRecord("x", logging.INFO, __file__, 1, "store at %s", ("mysql://u:pw@h/db",), None)
        >>> RedactingFilter().filter(record), record.getMessage()
        (True, 'store at mysql://u:***@h/db')
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: left to the handler, which reports it
            return True
        masked = redact_url(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_url("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        elif record.exc_text:
            record.exc_text = redact_url(record.exc_text)
        return True
