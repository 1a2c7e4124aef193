"""The error every checkpoint module raises; it imports nothing of the package, so any module can."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: missing, truncated, corrupt or foreign."""
