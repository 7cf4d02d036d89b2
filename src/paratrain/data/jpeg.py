"""JPEG bytes to pixels and back, for the packed cache: the fastest decoder installed.

Measured on 2 cores (benchmarks/jpeg_decode.py), a 256x341 JPEG at quality 90 decodes in
0.35 ms with simplejpeg (libjpeg-turbo, pip install 'paratrain[fast]') against 0.44 ms
with PIL, to the same pixels (both are libjpeg-turbo with its accurate DCT and fancy
upsampling; tested). Encoding uses PIL (0.28 ms against simplejpeg's 0.48)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

QUALITY = 90  # the packed cache's: FFCV's ImageNet default

try:
    import simplejpeg
except ImportError:  # the optional extra: PIL decodes the same pixels, a little slower
    simplejpeg = None

DECODER = "simplejpeg" if simplejpeg is not None else "PIL"


def encode(pixels: np.ndarray, quality: int = QUALITY) -> bytes:
    """HWC uint8 RGB pixels as JPEG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def decode(raw: bytes | memoryview, use: str = DECODER) -> np.ndarray:
    """JPEG bytes (RGB, as ``encode`` wrote them) as HWC uint8 pixels."""
    if use == "simplejpeg" and simplejpeg is not None:
        return simplejpeg.decode_jpeg(raw, colorspace="RGB")
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB"))
