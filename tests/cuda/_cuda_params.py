"""Parameters shared by the CUDA tier's test modules (not imported by ranks: it imports pytest)."""

from __future__ import annotations

import pytest

RANKS = [
    pytest.param(1, id="1rank"),
    pytest.param(2, id="2ranks", marks=pytest.mark.cuda(gpus=2)),
]
"""World sizes: one NCCL rank on one GPU, and two ranks on two GPUs (skipped with fewer)."""
