"""Errors a user can cause. The CLI prints them as one line and exits with their code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """Bad input: a path, a flag, a file. Reported as one line, exit code 2, no traceback."""

    exit_code = 2
    agreed = False  # True: every rank raises it alike, and rank 0 alone tells it


class AgreedUserError(UserError):
    """Raised alike on every rank (the same input, or after an agreement); rank 0 alone
    reports it, so a job of N processes prints it once."""

    agreed = True


NO_SPACE = (28, 122)  # ENOSPC, EDQUOT: the disk (or the user's quota) is full


class DiskFull(UserError):
    """A write that found its disk full: one line naming the path, the space it needed
    where known, and the space that is left there."""

    def __init__(self, path: object, needed: int | None = None):
        import shutil
        from pathlib import Path

        where = Path(str(path))
        folder = next((p for p in (where, *where.parents) if p.is_dir()), Path("."))
        try:
            free = f"{_size(shutil.disk_usage(folder).free)} free there"
        except OSError:
            free = "its free space unknown"
        wants = f" needs about {_size(needed)}," if needed else ""
        super().__init__(
            f"no space left on the disk of {where}: writing it{wants} {free}; free some "
            "space, or write elsewhere"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MB"


# how libraries that wrap the OS error say it (safetensors' SafetensorError, torch's zip
# writer): the C library's own words
NO_SPACE_WORDS = ("No space left on device", "Disk quota exceeded")


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in NO_SPACE:
        return True
    return isinstance(exc, Exception) and any(words in str(exc) for words in NO_SPACE_WORDS)


@contextmanager
def told_if_full(path: object, needed: int | None = None) -> Iterator[None]:
    """A full disk met inside the block is :class:`DiskFull` naming ``path``."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc) and not isinstance(exc, UserError):
            raise DiskFull(path, needed) from None
        raise
