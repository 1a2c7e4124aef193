"""The CUDA tier: tests marked ``cuda`` run on a GPU machine and are skipped, and counted, elsewhere.

``@pytest.mark.cuda`` needs one visible GPU; ``@pytest.mark.cuda(gpus=2)`` needs two. Without
them the test is skipped before any fixture runs, with the reason, and the summary says how
many tests of the tier did not run and the command that runs them on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch


def _gpus_needed(item: pytest.Item) -> int:
    return max((int(m.kwargs.get("gpus", 1)) for m in item.iter_markers("cuda")), default=0)


def _missing(needed: int) -> str | None:
    """Why a test needing ``needed`` GPUs cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False here"
    if torch.cuda.device_count() < needed:
        return f"needs {needed} CUDA GPUs: torch.cuda.device_count() is {torch.cuda.device_count()} here"
    if not torch.distributed.is_nccl_available():
        return "needs NCCL: torch.distributed.is_nccl_available() is False in this build of torch"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    needed = _gpus_needed(item)
    if needed:
        reason = _missing(needed)
        if reason is not None:
            pytest.skip(f"cuda tier: {reason}")
