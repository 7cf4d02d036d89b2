"""Files that readers find whole or not at all: fsync, and folders swapped into place;
and the locks that say who is writing.

A checkpoint, a cache, a split record: each is written under a temporary name, flushed
to the disk, then renamed; a reader finds the old one or the new one, never a torn one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

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


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or what it held before."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)
