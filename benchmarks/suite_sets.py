"""The time-to-accuracy suite's sets: generated image folders that differ in what makes
them hard, each written as ``root/{train,val}/class_k/*.jpg`` (80/20), deterministic
from ``seed``. Every set hides its classes under noise and nuisance variation (position,
scale, colour, background), so that accuracy climbs over the epochs:

* ``colour``  — 5 classes by the hue of a soft blob, under a per-image brightness and
  colour shift, on a textured background; shapes and sizes vary freely;
* ``shape``   — 5 classes by a drawn shape (disc, square, triangle, cross, ring) at any
  place and size, darker or lighter than a quiet background, every class alike in
  colour;
* ``texture`` — 5 classes by a texture (stripes, dots, checks, waves, blotches) at a
  random scale, angle and palette, filling the image;
* ``fine``    — 4 classes by where a fine 1-pixel checkerboard lies (top half, bottom
  half, both, neither: the rest is flat at the same mean), 73x73 originals: what a
  lower resolution averages into flat grey;
* ``many``    — 50 classes: 10 hues x 5 shapes, 40 images each;
* ``few``     — 10 classes (shape x texture), 30 images each at 480x360 (24 to train),
  and 24 more each to validate on: 300 validation images, where a fifth of 30 a class
  made 60, one of them 1.7 points of top-1 (a seed's spread, 6.2 points, was mostly
  the evaluation's own noise).

The embedded digits (``builtin:digits``) are the seventh set, used as they come.

    python benchmarks/suite_sets.py fine /tmp/fine       # writes one set
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("disc", "square", "triangle", "cross", "ring")
TEXTURES = ("stripes", "dots", "checks", "waves", "blotches")


def _save(
    root: Path, index: int, label: int, classes: int, pixels: np.ndarray, val: bool = False
) -> None:
    side = "val" if val or (index // classes) % 5 == 0 else "train"  # a fifth of each class
    folder = root / side / f"class_{label:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    image.save(folder / f"{index:05d}.jpg", quality=92)


def _background(rng: np.random.Generator, h: int, w: int, level: float = 120.0) -> np.ndarray:
    """Smooth random clutter: coarse noise upsampled, plus pixel noise."""
    coarse = rng.normal(level, 30, size=(max(2, h // 16), max(2, w // 16), 3))
    smooth = np.asarray(
        Image.fromarray(np.clip(coarse, 0, 255).astype(np.uint8)).resize((w, h), Image.BILINEAR),
        dtype=np.float32,
    )
    return smooth + rng.normal(0, 12, size=(h, w, 3))


def _shape_mask(
    rng: np.random.Generator, kind: str, h: int, w: int, larger: bool = False
) -> np.ndarray:
    """A filled shape of ``kind`` at a random place and size, as a 0/1 mask."""
    low, high = (0.45, 0.8) if larger else (0.25, 0.55)
    size = rng.uniform(low, high) * min(h, w)
    cx, cy = rng.uniform(size / 2, w - size / 2), rng.uniform(size / 2, h - size / 2)
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    half = size / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    if kind == "disc":
        draw.ellipse(box, fill=1)
    elif kind == "square":
        draw.rectangle(box, fill=1)
    elif kind == "triangle":
        draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=1)
    elif kind == "cross":
        bar = size / 3
        draw.rectangle((cx - half, cy - bar / 2, cx + half, cy + bar / 2), fill=1)
        draw.rectangle((cx - bar / 2, cy - half, cx + bar / 2, cy + half), fill=1)
    else:  # ring
        draw.ellipse(box, fill=1)
        inner = half * 0.55
        draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner), fill=0)
    return np.asarray(mask, dtype=np.float32)


def _texture(rng: np.random.Generator, kind: str, h: int, w: int) -> np.ndarray:
    """A texture of ``kind`` in [-1, 1], at a random scale and angle."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle, period = rng.uniform(0, np.pi), rng.uniform(5, 12) * max(h, w) / 128
    u = xx * np.cos(angle) + yy * np.sin(angle)
    v = -xx * np.sin(angle) + yy * np.cos(angle)
    if kind == "stripes":
        return np.sign(np.sin(2 * np.pi * u / period))
    if kind == "dots":
        return 2.0 * ((np.sin(np.pi * u / period) ** 2 * np.sin(np.pi * v / period) ** 2) > 0.5) - 1
    if kind == "checks":
        return np.sign(np.sin(np.pi * u / period) * np.sin(np.pi * v / period))
    if kind == "waves":
        return np.sin(
            2 * np.pi * (u + 0.3 * period * np.sin(2 * np.pi * v / (3 * period))) / period
        )
    coarse = rng.normal(0, 1, size=(max(2, int(h / period)), max(2, int(w / period))))
    blot = Image.fromarray(((coarse > 0) * 255).astype(np.uint8)).resize((w, h), Image.BILINEAR)
    return np.asarray(blot, dtype=np.float32) / 127.5 - 1


def _hue(label: int, classes: int) -> np.ndarray:
    """``classes`` colours around the hue circle at one saturation, as RGB 0-255."""
    import colorsys

    return np.array(colorsys.hsv_to_rgb(label / classes, 0.55, 0.8)) * 255


def colour(rng: np.random.Generator, label: int) -> np.ndarray:
    h, w = 96, 128
    pixels = _background(rng, h, w)
    mask = _shape_mask(rng, SHAPES[rng.integers(len(SHAPES))], h, w)
    soft = np.asarray(Image.fromarray((mask * 255).astype(np.uint8)).resize((w // 4, h // 4)).resize(
        (w, h), Image.BILINEAR), dtype=np.float32)[..., None] / 255  # fmt: skip
    tint = _hue(label, 5) + rng.normal(0, 18, size=3)  # neighbours' hues overlap
    pixels = pixels * (1 - soft) + tint * soft
    return pixels * rng.uniform(0.75, 1.25) + rng.normal(0, 20, size=(h, w, 3))


def shape(rng: np.random.Generator, label: int) -> np.ndarray:
    h, w = 96, 128
    level = rng.uniform(60, 190)
    pixels = level + (_background(rng, h, w, 0.0) - 0.0) * 0.4  # quieter clutter
    mask = _shape_mask(rng, SHAPES[label], h, w, larger=True)[..., None]
    fill = np.clip(level + rng.choice([-1, 1]) * rng.uniform(50, 80) + rng.normal(0, 15, 3),
                   0, 255)  # fmt: skip
    return pixels * (1 - mask) + fill * mask + rng.normal(0, 12, size=(h, w, 3))


def texture(rng: np.random.Generator, label: int) -> np.ndarray:
    h, w = 96, 128
    low, high = rng.uniform(40, 200, size=3), rng.uniform(40, 200, size=3)
    t = (_texture(rng, TEXTURES[label], h, w)[..., None] + 1) / 2
    return low * (1 - t) + high * t + rng.normal(0, 35, size=(h, w, 3))


def fine(rng: np.random.Generator, label: int) -> np.ndarray:
    """Where a 1-pixel checkerboard lies: 0 top, 1 bottom, 2 both, 3 neither. 73 pixels a
    side: what validation at 64 px resizes to (64 / 0.875), so that it sees the checks
    whole, where a lower size averages them away."""
    h = w = 73
    yy, xx = np.mgrid[0:h, 0:w]
    checker = ((yy + xx) % 2 * 2 - 1).astype(np.float32)
    where = np.zeros((h, 1), np.float32)
    cut = h // 2 + int(rng.integers(-6, 7))  # the border moves: no fixed line to learn
    if label in (0, 2):
        where[:cut] = 1
    if label in (1, 2):
        where[cut:] = 1
    base = rng.uniform(70, 180) + _background(rng, h, w, 0.0) * 0.5  # coarse, class-free
    return base[..., :3] + (rng.uniform(20, 35) * checker * where)[..., None] + rng.normal(
        0, 10, size=(h, w, 3))  # fmt: skip


def many(rng: np.random.Generator, label: int) -> np.ndarray:
    h, w = 96, 128
    hue, kind = divmod(label, len(SHAPES))
    pixels = _background(rng, h, w)
    mask = _shape_mask(rng, SHAPES[kind], h, w)[..., None]
    tint = _hue(hue, 10) + rng.normal(0, 10, size=3)
    return pixels * (1 - mask) + tint * mask + rng.normal(0, 20, size=(h, w, 3))


def few(rng: np.random.Generator, label: int) -> np.ndarray:
    h, w = 360, 480
    kind, pattern = SHAPES[label % 5], TEXTURES[label // 5 * 2]  # stripes or checks
    pixels = _background(rng, h, w)
    mask = _shape_mask(rng, kind, h, w)[..., None]
    t = (_texture(rng, pattern, h, w)[..., None] + 1) / 2
    fill = rng.uniform(40, 120, size=3) * (1 - t) + rng.uniform(140, 220, size=3) * t
    return pixels * (1 - mask) + fill * mask + rng.normal(0, 25, size=(h, w, 3))


# name: (the image of a label, classes, images split 80/20, more images to validate on)
SETS: dict[str, tuple[Callable[[np.random.Generator, int], np.ndarray], int, int, int]] = {
    "colour": (colour, 5, 2000, 0),
    "shape": (shape, 5, 2000, 0),
    "texture": (texture, 5, 2000, 0),
    "fine": (fine, 4, 2000, 0),
    "many": (many, 50, 2000, 0),
    "few": (few, 10, 300, 240),
}
DIGITS = "builtin:digits"


def make_set(name: str, root: Path, images: int | None = None, part: int = 0, parts: int = 1,
             seed: int = 0) -> Path:  # fmt: skip
    """Writes set ``name`` (``images`` of them split 80/20, else its own count and its
    validation-only images after them) under ``root``: every ``parts``-th image from
    ``part`` on, so that processes can share the writing."""
    draw, classes, count, more_val = SETS[name]
    split = images or count  # those split 80/20; any after them only validate
    for index in range(part, split + (0 if images else more_val), parts):
        rng = np.random.default_rng([seed, index])
        label = index % classes
        _save(root, index, label, classes, draw(rng, label), val=index >= split)
    return root


def described(name: str) -> str:
    """What ``make_set`` writes of ``name`` by default, in words (a folder written
    before a set changed is told apart by it)."""
    _, classes, count, more_val = SETS[name]
    return f"{name}: {classes} classes, {count} images split 80/20, {more_val} more to validate on"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SETS))
    parser.add_argument("root", type=Path)
    parser.add_argument("--images", type=int)
    args = parser.parse_args()
    make_set(args.name, args.root, args.images)
    print(f"wrote {args.name} to {args.root}", file=sys.stderr)


if __name__ == "__main__":
    main()
