"""Small helpers shared by the package: logging and seeding."""

from unison.utils.logging import get_logger, setup_logging
from unison.utils.events import read_scalars
from unison.utils.seed import manual_seed

__all__ = ["get_logger", "manual_seed", "read_scalars", "setup_logging"]
