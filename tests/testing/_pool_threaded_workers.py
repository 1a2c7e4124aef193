"""A rank function whose module starts a thread as it is imported (tests/testing/test_pool.py)."""

from __future__ import annotations

import os
import threading
import time

IMPORTED_IN = os.getpid()
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


def imported_in() -> int:
    return IMPORTED_IN
