"""``raw``: HWC uint8 pixels in one flat file, memory-mapped. Nothing to decode, so the
fastest to read, and bit for bit the decode path's evaluation input; as large as the
pixels (ImageNet at 224 px: about 335 GB). Its index is laid out and its file's blocks
reserved before the build, so a full disk is an error then, not a SIGBUS later; the
processes that decode write each image into its slot.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from paratrain.data.cache.base import CacheKind, Sizing, Stored, shapes

FILE = "data.u8"


def reserve(path: Path, nbytes: int) -> None:
    """A file of ``nbytes`` with its disk blocks allocated now; where the file system
    cannot allocate ahead, a sparse file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: not supported here
                raise
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


class _InSlots(Stored):
    def __init__(self, directory: Path):
        self.directory = directory
        self.index = np.load(directory / "index.npy")
        self.data: np.memmap | None = None  # opened in the process that writes

    def store(self, i: int, pixels: np.ndarray) -> tuple[str | None, Any]:
        if self.data is None:
            self.data = np.memmap(self.directory / FILE, dtype=np.uint8, mode="r+")
        _, offset, nbytes, height, width = (int(v) for v in self.index[i])
        if pixels.shape != (height, width, 3):
            return "changed while the cache was built", None
        self.data[offset : offset + nbytes] = pixels.reshape(-1)
        return None, None


class Raw(CacheKind):
    name = "raw"

    def part_names(self, directory: Path) -> list[str]:
        return [FILE]

    def size(self, sizing: Sizing) -> tuple[int, np.ndarray | None]:
        if not sizing.asked and sizing.raw_bytes > sizing.budget:
            return sizing.raw_bytes, None  # refused: no need to read every header
        counted = sizing.exact if sizing.exact is not None else shapes(sizing.samples, sizing.short)
        return int((counted[:, 0] * counted[:, 1] * 3).sum()), counted

    def refuses(self, nbytes: int, sizing: Sizing) -> str | None:
        if nbytes <= sizing.budget:
            return None
        return (
            f"raw pixels would take {nbytes / 2**30:.1f} GB, over --cache-max-gb {sizing.max_gb:g}"
        )

    def chosen(self, nbytes: int, sizing: Sizing) -> str:
        return f"raw pixels, {nbytes / 2**30:.2f} GB (within --cache-max-gb {sizing.max_gb:g})"

    def lay_out(self, tmp: Path, shapes: np.ndarray | None, nbytes: int) -> str | None:
        assert shapes is not None  # a raw build has every image's shape
        sizes = shapes[:, 0] * shapes[:, 1] * 3
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        rows = np.column_stack([np.zeros_like(offsets), offsets, sizes, shapes])
        np.save(tmp / "index.npy", rows.astype(np.int64))
        try:
            reserve(tmp / FILE, max(nbytes, 1))
        except OSError as exc:
            return f"cannot reserve {nbytes / 2**30:.2f} GB in {tmp.parent} ({exc.strerror or exc})"
        return None

    def stored(self, directory: Path) -> Stored:
        return _InSlots(directory)

    def pixels(self, stored: np.ndarray, height: int, width: int) -> np.ndarray:
        return np.array(stored).reshape(height, width, 3)


KIND = Raw()
