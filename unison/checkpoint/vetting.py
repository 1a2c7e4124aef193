"""What every rank of a save does with rank 0's verdict on the state it collected."""

from __future__ import annotations

from typing import Any

from unison.checkpoint.manifest import Manifest
from unison.checkpoint.ranks import agreed_verdict
from unison.checkpoint.verify import raise_refusal, skip_message
from unison.distributed.primitives import get_rank
from unison.utils.logging import get_logger

_log = get_logger(__name__)


def vetted(
    state: dict[str, Any] | None,
    problem: Exception | None,
    manifest: Manifest,
    iteration: int,
    *,
    finite: bool = True,
) -> tuple[dict[str, Any] | None, bool]:
    """Collective: every rank acts on rank 0's verdict (``ranks.agreed_verdict``).

    Returns the state to write (rank 0; None elsewhere) and whether to write: False for
    weights that are not finite (rank 0 logs a warning naming the first bad tensor and the
    newest file kept). Raises rank 0's refusal on every rank. With ``finite=False`` rank 0's
    weights are left to its writer's check (``verify.finite_check``).
    """
    state, verdict = agreed_verdict(state, problem, finite=finite)
    if verdict is None:
        return state, True
    raise_refusal(verdict)
    if get_rank() == 0:
        _log.warning(skip_message(verdict, manifest, iteration))
    return None, False
