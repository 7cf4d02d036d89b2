"""The embedded default data set: 1,797 handwritten digits, 8x8 scans.

They ship in this package (``digits.npz``, 45 KB: the pixels at 0-16 grey levels and
the labels), and are written once as a PNG image folder under a cache directory, so the
default run goes through exactly the same folder-loading code as a user's own data.

The scans are the test part of the UCI "Optical Recognition of Handwritten Digits" data
set (E. Alpaydin, C. Kaynak, 1998; https://doi.org/10.24432/C50P49), licensed CC BY 4.0,
as scikit-learn distributes them (``sklearn.datasets.load_digits``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

DIGITS_DIRNAME = "digits-v1"
DIGITS_FILE = Path(__file__).with_name("digits.npz")


def default_cache_dir() -> Path:
    """$PARATRAIN_CACHE, else $XDG_CACHE_HOME/paratrain, else ~/.cache/paratrain."""
    base = os.environ.get("PARATRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "paratrain"
    )
    return Path(base)


def digits_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the digits image folder is (or will be) written."""
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / DIGITS_DIRNAME


def digits_ready(cache_dir: str | Path | None = None) -> bool:
    """Whether the digits folder was written whole (its COMPLETE marker is there)."""
    return (digits_dir(cache_dir) / "COMPLETE").exists()


def ensure_digits(cache_dir: str | Path | None = None) -> Path:
    """Return the digits image folder, writing it first if it is not there yet.

    The folder is built in a temporary directory and renamed into place, so processes
    racing to create it never see a half-written folder.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache / DIGITS_DIRNAME
    if (target / "COMPLETE").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with np.load(DIGITS_FILE) as digits:
        images, labels = digits["images"], digits["labels"]
    staging = Path(tempfile.mkdtemp(prefix=".digits-", dir=cache))
    try:
        scaled = np.clip(images * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
        for index, (pixels, label) in enumerate(zip(scaled, labels, strict=True)):
            class_dir = staging / str(int(label))
            class_dir.mkdir(exist_ok=True)
            Image.fromarray(pixels, mode="L").save(class_dir / f"{index:04d}.png")
        (staging / "COMPLETE").write_text(f"{len(scaled)} images\n")
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "COMPLETE").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
