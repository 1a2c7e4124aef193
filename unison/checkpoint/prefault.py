"""New memory faulted in ahead of the reads that fill it.

``torch.load`` reads each record into a tensor it has just allocated: memory the kernel has not
given pages yet. A read into it takes a page fault for every 4 KiB inside the kernel's copy,
one after the other in the reading thread. Measured on a 2-CPU virtual machine, reading a
cold 1 GB file into fresh memory ran at 0.6-1.8 GB/s, into memory already faulted in at
2.5 GB/s (the disk's speed); ``madvise(MADV_POPULATE_WRITE)`` faulted fresh memory in at
3 GB/s. :class:`FaultAhead` has another thread fault in the pages of the next blocks of a
buffer while the reading thread fills the current one: reading into fresh memory then ran
at 2.3-2.5 GB/s.

``MADV_POPULATE_WRITE`` (Linux 5.14) gives the pages without writing them: a page already
there is left as it is, a new one reads as zeros, as it would have. Where the call is
missing or refused, nothing is faulted ahead and the reads fault as before.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["AHEAD", "FROM", "FaultAhead", "address", "populate"]

FROM = 16 << 20
"""Buffers of this many bytes or more are faulted in ahead (16 MiB): a smaller one is mostly
the allocator's memory already in use."""
AHEAD = 2
"""Blocks faulted in ahead of the one being read."""
_PAGE = 4096
_MADV_POPULATE_WRITE = 23
_madvise: Callable[..., int] | None = None
_works = sys.platform.startswith("linux")  # False once the kernel refused the call


def populate(address: int, length: int) -> bool:
    """Faults in, writable, the whole pages of ``length`` bytes of this process's memory from
    ``address``; whether the kernel did (False where the call is missing or refused)."""
    global _madvise, _works
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if not _works or end <= start:
        return False
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            call = libc.madvise
        except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
            _works = False
            return False
        call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        call.restype = ctypes.c_int
        _madvise = call
    if _madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:  # releases the GIL while it faults
        if ctypes.get_errno() == 22:  # EINVAL: a kernel before 5.14
            _works = False
        return False
    return True


def address(view: memoryview) -> int:
    """Where a writable buffer's first byte is in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))  # the export ends with the expression


class FaultAhead:
    """Faults in the pages of ``view``'s blocks (``spans``: (offset, length) pairs, in the order
    they are read) by ``pool``'s thread, :data:`AHEAD` blocks ahead of the reading thread. The
    first block is faulted in by its own read, which starts at once.

    Call :meth:`before` with each block's index before reading it, and :meth:`close` before
    handing the buffer back: no fault-in touches it after that.
    """

    def __init__(self, view: memoryview, spans: Sequence[tuple[int, int]], pool: Executor) -> None:
        self.base = address(view)
        self.spans = spans
        self.pool = pool
        self._futures: dict[int, Future[bool]] = {}
        self._next = 1  # the first block not yet handed to the pool (block 0: its read faults it in)

    def before(self, index: int) -> None:
        """Hands the blocks up to ``index + AHEAD`` to the pool and waits for block ``index``'s."""
        while _works and self._next < len(self.spans) and self._next <= index + AHEAD:
            offset, length = self.spans[self._next]
            self._futures[self._next] = self.pool.submit(populate, self.base + offset, length)
            self._next += 1
        future = self._futures.pop(index, None)
        if future is not None:
            future.result()

    def close(self) -> None:
        """Waits for the fault-ins still in flight."""
        while self._futures:
            self._futures.popitem()[1].result()

    def __enter__(self) -> FaultAhead:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
