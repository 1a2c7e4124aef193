"""Small helpers shared by the package: logging and seeding."""

from unison.utils.logging import get_logger, setup_logging
from unison.utils.seed import manual_seed

__all__ = ["get_logger", "manual_seed", "setup_logging"]
