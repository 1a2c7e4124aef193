"""The error every config problem raises: file, line, key path, and what to do."""

from __future__ import annotations

from collections.abc import Sequence

from unison.utils.secrets import redact_url


class ConfigError(ValueError):
    """A config that cannot be used. The message reads ``file:line: key.path: problem``; a URL's
    credentials quoted in it are masked (:func:`~unison.utils.secrets.redact_url`).

    Attributes:
        file: the config file.
        line: the line of the key (1-based), when known.
        key_path: the dotted key path, when the problem has one.
    """

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, key: Sequence[str] = ()
    ):
        self.file = file
        self.line = line
        self.key_path = ".".join(key)
        self.problem = redact_url(message)
        where = file or "<config>"
        if line is not None:
            where += f":{line}"
        if self.key_path:
            where += f": {self.key_path}"
        # each part on its own ("where" may be a --set with its value): a URL's password runs to
        # the last "@" of its line, which may be in the other part
        super().__init__(f"{redact_url(where)}: {self.problem}")
