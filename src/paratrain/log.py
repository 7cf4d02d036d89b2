"""A rank-aware logger: rank 0 prints to stdout, other ranks only warnings and errors.

``print`` is never replaced globally; code that must speak calls ``log.info``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

_LOGGER_NAME = "paratrain"
STARTED = "PARATRAIN_STARTED"  # when the command started (epoch seconds), for its processes
COMMAND_PID = "PARATRAIN_COMMAND_PID"  # the `paratrain` command's own process


def mark_start(reset: bool = False) -> None:
    """Note now as the command's start, for this process and those it starts; a
    process that a launcher started keeps the launcher's (``reset``: a new command in
    this process, such as another in-process run, starts now; not the `paratrain`
    command's own process, whose start is its process's: :func:`mark_process_start`)."""
    if reset and os.environ.get(COMMAND_PID) != str(os.getpid()):
        os.environ[STARTED] = repr(time.time())
    else:
        os.environ.setdefault(STARTED, repr(time.time()))


def mark_process_start() -> None:
    """The `paratrain` command: it started when its process did, so the seconds it told
    ("done in", the first step, a budget's) include its imports, as a user's clock
    does; a process that a launcher started keeps the launcher's start."""
    if STARTED in os.environ:
        return
    age = _process_age()
    os.environ[STARTED] = repr(time.time() - (age if age is not None else 0.0))
    os.environ[COMMAND_PID] = str(os.getpid())


def _process_age() -> float | None:
    """Seconds since this process started (Linux's /proc), None where unknown."""
    try:  # field 22 of /proc/self/stat: the process's start, in clock ticks after boot
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def since_start() -> float:
    """Seconds since the command started (``mark_start``), else since this process did."""
    if STARTED in os.environ:
        try:
            return time.time() - float(os.environ[STARTED])
        except ValueError:
            pass
    age = _process_age()
    return age if age is not None else time.process_time()


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
