"""``zlib``: each image's pixels deflated (zlib, level 1) into a few large files with an
index, as ``packed`` keeps its JPEGs. Lossless, so validation reads it as it reads
``raw`` (bit for bit the decode path's input), and smaller than raw where images have
flat regions (scans, renders, synthetic sets); inflating costs more than a memory map
and less than a JPEG. Only when named (``--cache zlib``): auto never takes it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from paratrain.data.cache.base import Stored
from paratrain.data.cache.packed import Packed


class _Deflated(Stored):
    def store(self, i: int, pixels: np.ndarray) -> tuple[str | None, Any]:
        return None, (pixels.shape[0], pixels.shape[1], zlib.compress(pixels.tobytes(), 1))


class Zlib(Packed):
    name = "zlib"
    tag = "1"
    lossless = True
    encoded = False
    in_auto = False
    suffix = ".z"

    def manifest_fields(self) -> dict:
        return {"level": 1}

    def stored(self, directory: Any) -> Stored:
        return _Deflated()

    def pixels(self, stored: np.ndarray, height: int, width: int) -> np.ndarray:
        flat = np.frombuffer(zlib.decompress(stored.tobytes()), np.uint8)
        return flat.reshape(height, width, 3)


KIND = Zlib()
