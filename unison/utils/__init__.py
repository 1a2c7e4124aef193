"""Small helpers shared by the package: logging, seeding, reading TensorBoard event files."""

from typing import Any

from unison.utils.logging import get_logger, setup_logging
from unison.utils.seed import fork_rank_streams, manual_seed, rank_seed

__all__ = ["fork_rank_streams", "get_logger", "manual_seed", "rank_seed", "read_scalars", "setup_logging"]


def __getattr__(name: str) -> Any:
    # The event reader needs tensorboardX's protobufs: imported on first use, not with unison.
    if name == "read_scalars":
        from unison.utils.event_files import read_scalars

        return read_scalars
    raise AttributeError(f"module 'unison.utils' has no attribute {name!r}")
