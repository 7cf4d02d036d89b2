"""The embedded digits set ships in the package: written as an image folder without
scikit-learn, the same pixels every time."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from PIL import Image

from paratrain.data.builtin import DIGITS_FILE, ensure_digits
from paratrain.data.folder import build_split


def test_the_digits_are_written_from_the_package_alone(tmp_path):
    blocked = "import sys; sys.modules['sklearn'] = None; "  # importing it would fail
    code = f"{blocked}from paratrain.data.builtin import ensure_digits; ensure_digits({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    split = build_split(tmp_path / "digits-v1")
    assert split.classes == [str(d) for d in range(10)]
    assert len(split.train) + len(split.val) == 1797


def test_the_written_pixels_are_the_scans_scaled_to_8_bits(tmp_path):
    folder = ensure_digits(tmp_path)
    with np.load(DIGITS_FILE) as digits:
        images, labels = digits["images"], digits["labels"]
    assert images.shape == (1797, 8, 8) and images.max() == 16
    for index in (0, 900, 1796):
        png = np.asarray(Image.open(folder / str(labels[index]) / f"{index:04d}.png"))
        assert np.array_equal(png, np.round(images[index] * (255 / 16)).astype(np.uint8))
