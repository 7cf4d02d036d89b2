"""A rank-aware logger: rank 0 prints to stdout, other ranks only warnings and errors.

``print`` is never replaced globally; code that must speak calls ``log.info``.
"""

from __future__ import annotations

import logging
import sys

_LOGGER_NAME = "paratrain"


def get_logger() -> logging.Logger:
    """paratrain's logger: what code that must speak uses (print is never replaced)."""
    return logging.getLogger(_LOGGER_NAME)


def setup_logging(rank: int = 0, world_size: int = 1) -> logging.Logger:
    """Rank 0 logs to stdout; other ranks only warnings and errors, prefixed with their rank."""
    logger = get_logger()
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank {rank}] " if world_size > 1 and rank != 0 else ""
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger
