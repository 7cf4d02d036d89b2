"""Files that readers find whole or not at all: fsync, and folders swapped into place;
and the locks that say who is writing.

A checkpoint, a cache, a split record: each is written under a temporary name, flushed
to the disk, then renamed; a reader finds the old one or the new one, never a torn one.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from filelock import BaseFileLock


def try_lock(path: Path | str) -> BaseFileLock | None:
    """The lock at ``path``, taken now, or None while another process holds it: never
    waits (the holder may be a node of this very job). filelock's FileLock: an flock,
    which the kernel lets go when its process ends, however it ends; on a file system
    without flock (some NFS and Lustre mounts) a lock file in its place, whose holder
    (pid and host) is recorded in it and recovered from when that process is gone."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path), timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        return None
    return lock


def fsync(path: Path | str) -> None:
    """Push a file's (or a folder's entries') writes to the disk."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems cannot fsync a folder
    finally:
        os.close(descriptor)


def swap_in(tmp: Path, target: Path) -> None:
    """Folder ``tmp`` becomes ``target``: a reader finds the old folder or the new one
    (or, between the two renames, the old one under its parked name ``.<name>.old``)."""
    parked = target.with_name(f".{target.name}.old")
    shutil.rmtree(parked, ignore_errors=True)
    if target.exists():
        os.rename(target, parked)
    os.rename(tmp, target)
    fsync(target.parent)
    shutil.rmtree(parked, ignore_errors=True)


@contextmanager
def replaced(path: Path) -> Iterator[BinaryIO]:
    """The one way a file is written whole or not at all: a file object whose bytes
    become ``path`` when the block ends (flushed, fsynced, renamed over it, its folder
    fsynced). On an error the temporary file is removed and ``path`` is as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # created as open() creates (0666 less the umask): others may read a run's files
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync(path.parent)


def write_atomic(path: Path, data: bytes | str) -> None:
    """``path`` holds ``data`` whole (text as UTF-8), or what it held before."""
    with replaced(path) as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
