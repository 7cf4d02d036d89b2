"""The embedded default data set: scikit-learn's bundled handwritten digits.

1,797 real 8x8 scans of the digits 0-9 ship inside scikit-learn; they are written once
as a PNG image folder under a cache directory, so the default run goes through exactly
the same folder-loading code as a user's own data.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

DIGITS_DIRNAME = "digits-v1"


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
    from sklearn.datasets import load_digits

    cache.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    staging = Path(tempfile.mkdtemp(prefix=".digits-", dir=cache))
    try:
        scaled = np.clip(digits.images * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
        for index, (pixels, label) in enumerate(zip(scaled, digits.target, strict=True)):
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
