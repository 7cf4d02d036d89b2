"""``packed``: each image re-encoded as a JPEG at quality 90 into a few large files (one
per building rank) with an index, as FFCV keeps ImageNet (tens of GB): a small JPEG
decodes several times faster than the original photo. Lossy, so validation still decodes
the originals (exact evaluation stays exact). The processes that decode send each JPEG
back; the rank appends it to its part file and notes its row, and the node's builder
merges the rows into the index at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from paratrain.data import jpeg
from paratrain.data.cache.base import (
    SIZING_SAMPLE,
    CacheKind,
    Collected,
    Sizing,
    Stored,
    resized,
    sample_rows,
)


class _Encoded(Stored):
    def store(self, i: int, pixels: np.ndarray) -> tuple[str | None, Any]:
        return None, (pixels.shape[0], pixels.shape[1], jpeg.encode(pixels))


class _Appended(Collected):
    def __init__(self, directory: Path, local_rank: int, suffix: str):
        self.directory, self.local_rank = directory, local_rank
        self.out = open(directory / f"part-{local_rank:03d}{suffix}", "wb")
        self.rows: list[tuple[int, ...]] = []
        self.offset = 0

    def add(self, i: int, payload: Any) -> None:
        height, width, encoded = payload
        self.out.write(encoded)
        self.rows.append((i, self.local_rank, self.offset, len(encoded), height, width))
        self.offset += len(encoded)

    def close(self) -> None:
        self.out.close()
        rows = np.array(self.rows, np.int64).reshape(-1, 6)
        np.save(self.directory / f"rows-{self.local_rank:03d}.npy", rows)


class Packed(CacheKind):
    name = "packed"
    tag = str(jpeg.QUALITY)
    lossless = False
    encoded = True
    suffix = ".jpg"  # of its part files

    def manifest_fields(self) -> dict:
        return {"quality": jpeg.QUALITY}

    def part_names(self, directory: Path) -> list[str]:
        return sorted(p.name for p in directory.glob("part-*"))

    def size(self, sizing: Sizing, tries: int = 16) -> tuple[int, np.ndarray | None]:
        """Raw bytes times the JPEG ratio of a few entries."""
        samples, raw, packed = sizing.samples, 0, 0
        every = max(1, min(len(samples), SIZING_SAMPLE) // tries)
        for i in sample_rows(len(samples))[::every]:
            pixels, _ = resized(samples, int(i), sizing.short, sizing.interpolation)
            if pixels is not None:
                raw += pixels.size
                packed += len(jpeg.encode(pixels))
        return (int(sizing.raw_bytes * packed / raw) if raw else sizing.raw_bytes), None

    def refuses(self, nbytes: int, sizing: Sizing) -> str | None:
        if nbytes * 1.1 <= sizing.free:
            return None
        return (
            f"packed JPEG about {nbytes / 2**30:.1f} GB, more than the "
            f"{sizing.free / 2**30:.1f} GB free"
        )

    def chosen(self, nbytes: int, sizing: Sizing) -> str:
        return f"packed JPEG, about {nbytes / 2**30:.1f} GB on disk"

    def stored(self, directory: Path) -> Stored:
        return _Encoded()

    def collected(self, directory: Path, local_rank: int) -> Collected:
        return _Appended(directory, local_rank, self.suffix)

    def finish(self, tmp: Path, images: int) -> None:
        index = np.zeros((images, 5), np.int64)
        for found in sorted(tmp.glob("rows-*.npy")):
            rows = np.load(found)
            index[rows[:, 0]] = rows[:, 1:]
            found.unlink()
        np.save(tmp / "index.npy", index)

    def pixels(self, stored: np.ndarray, height: int, width: int) -> np.ndarray:
        return jpeg.decode(stored.tobytes())


KIND = Packed()
