"""Collecting the records of the ``unison`` logger inside a test or a spawned rank."""

from __future__ import annotations

import logging
from typing import Any


class LogRecords(logging.Handler):
    """Collects the messages of the ``unison`` logger written while it is installed."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LogRecords:
        logging.getLogger("unison").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("unison").removeHandler(self)
