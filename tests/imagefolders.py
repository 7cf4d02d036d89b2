"""Generate small labelled image folders whose classes are learnable (by colour)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

PALETTE = [
    (220, 40, 40),
    (40, 200, 60),
    (40, 60, 220),
    (230, 200, 30),
    (160, 40, 200),
    (30, 200, 200),
    (240, 120, 20),
    (120, 120, 120),
    (250, 250, 250),
    (10, 10, 10),
]


def make_image_folder(
    root: Path,
    classes: int = 3,
    per_class: int = 12,
    size: tuple[int, int] = (40, 30),
    layout: str = "split",
    seed: int = 0,
    ext: str = ".jpg",
) -> Path:
    """``root/<class>/*`` (layout "split") or ``root/{train,val}/<class>/*`` ("given")."""
    rng = np.random.default_rng(seed)
    names = [f"class_{i}" for i in range(classes)]
    subsets = (
        [("", per_class)]
        if layout == "split"
        else [("train", per_class), ("val", max(2, per_class // 3))]
    )
    for subset, count in subsets:
        for c, name in enumerate(names):
            folder = root / subset / name
            folder.mkdir(parents=True, exist_ok=True)
            base = np.array(PALETTE[c % len(PALETTE)], dtype=np.float32)
            for i in range(count):
                noise = rng.normal(0, 25, size=(size[1], size[0], 3))
                pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}{ext}")
    return root


def make_damaged_folder(root, classes=3, per_class=34):
    """3% truncated JPEGs, 1% zero-byte files and stray .txt files."""
    data = make_image_folder(root, classes=classes, per_class=per_class, size=(64, 48))
    images = sorted(p for p in data.rglob("*.jpg"))
    rng = np.random.default_rng(1)
    picked = rng.choice(len(images), size=4, replace=False)
    truncated = [images[i] for i in picked[:3]]
    empty = [images[picked[3]]]
    for path in truncated:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for path in empty:
        path.write_bytes(b"")
    for c in range(classes):
        (data / f"class_{c}" / "notes.txt").write_text("not an image")
    return data, sorted(str(p) for p in truncated + empty)
