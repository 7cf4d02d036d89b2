"""Scan and validate an image folder, split it into train/val, hold the class index.

Two layouts are accepted:

* ``DIR/<class>/*.jpg``: split deterministically, the same fraction of every class to
  validation, with a fixed seed (the same split on every rank and every run);
* ``DIR/train/<class>`` and ``DIR/val/<class>``: used as given; both need the same classes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset

from paratrain.errors import UserError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

Sample = tuple[str, int]


@dataclass(frozen=True)
class DataSplit:
    classes: list[str]
    train: list[Sample]
    val: list[Sample]
    layout: str  # "split" (one folder, split here) or "given" (train/ and val/)
    root: str
    ignored: int = 0  # files without an image extension, left out

    def class_index(self) -> dict[str, str]:
        """index -> class name, as written to class_indices.json."""
        return {str(i): name for i, name in enumerate(self.classes)}


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def scan_classes(root: Path, ignored: list[str] | None = None) -> dict[str, list[str]]:
    """Map each class folder under ``root`` to its sorted image paths; files without an
    image extension go to ``ignored``."""
    if not root.exists():
        raise UserError(f"data directory does not exist: {root}")
    if not root.is_dir():
        raise UserError(f"data path is not a directory: {root}")
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    class_dirs = [e for e in entries if e.is_dir() and not e.name.startswith(".")]
    if not class_dirs:
        if not entries:
            raise UserError(f"data directory is empty: {root}")
        raise UserError(f"no class folders in {root} (expected {root}/<class>/<image>)")
    classes: dict[str, list[str]] = {}
    for entry in class_dirs:
        files = [
            os.path.join(dirpath, f)
            for dirpath, _, names in os.walk(entry.path, followlinks=True)
            for f in names
            if not f.startswith(".")
        ]
        images = sorted(f for f in files if _is_image(f))
        if ignored is not None:
            ignored.extend(f for f in files if not _is_image(f))
        if not images:
            raise UserError(f"class folder has no images: {entry.path}")
        classes[entry.name] = images
    if len(classes) < 2:
        raise UserError(
            f"{root} holds one class folder ({next(iter(classes))}); a classifier needs at "
            f"least 2 ({root}/<class>/<image>, one folder per class)"
        )
    return classes


def _is_given_split(root: Path) -> bool:
    return (root / "train").is_dir() and (root / "val").is_dir()


def build_split(data_dir: str | Path, val_fraction: float = 0.2, seed: int = 0) -> DataSplit:
    """The classes and the train/val samples of a folder, in either layout; the same on every rank and every run (a fixed seed per class)."""
    root = Path(data_dir).expanduser()
    ignored: list[str] = []
    if _is_given_split(root):
        train = scan_classes(root / "train", ignored)
        val = scan_classes(root / "val", ignored)
        if set(train) != set(val):
            only_train = sorted(set(train) - set(val))
            only_val = sorted(set(val) - set(train))
            raise UserError(
                f"train/val class folders differ in {root}: "
                f"only in train: {only_train or 'none'}; only in val: {only_val or 'none'}"
            )
        classes = sorted(train)
        return DataSplit(
            classes=classes,
            train=_label(train, classes),
            val=_label(val, classes),
            layout="given",
            root=str(root),
            ignored=len(ignored),
        )
    by_class = scan_classes(root, ignored)
    classes = sorted(by_class)
    training: list[Sample] = []
    validation: list[Sample] = []
    for index, name in enumerate(classes):
        paths = by_class[name]
        if len(paths) < 2:
            raise UserError(
                f"class folder {root / name} has {len(paths)} image; at least 2 are needed "
                f"to split it into train and val"
            )
        train_paths, val_paths = split_class(paths, val_fraction, seed + index)
        training += [(p, index) for p in train_paths]
        validation += [(p, index) for p in val_paths]
    return DataSplit(
        classes=classes,
        train=training,
        val=validation,
        layout="split",
        root=str(root),
        ignored=len(ignored),
    )


def split_class(paths: Sequence[str], val_fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic per-class split: at least one image on each side."""
    n = len(paths)
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    val_ids = set(order[:n_val].tolist())
    train = [p for i, p in enumerate(paths) if i not in val_ids]
    val = [p for i, p in enumerate(paths) if i in val_ids]
    return train, val


def _label(by_class: dict[str, list[str]], classes: list[str]) -> list[Sample]:
    return [(p, i) for i, name in enumerate(classes) for p in by_class[name]]


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode as 3-channel RGB, turned upright as its EXIF orientation says.

    L, LA, P, RGBA, CMYK convert directly (alpha is dropped, palettes with transparency
    go through RGBA); 16- and 32-bit greyscale (I;16, I, F) are scaled to 8 bits first.
    """
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        pixels = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else max(float(pixels.max()), 1.0)
        image = Image.fromarray(np.clip(pixels * (255.0 / top), 0, 255).round().astype(np.uint8))
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image if image.mode == "RGB" else image.convert("RGB")


# what opening or decoding a file that is not a usable image raises; a decompression
# bomb (more than twice Pillow's MAX_IMAGE_PIXELS) is one of them
IMAGE_ERRORS = (
    UnidentifiedImageError,
    OSError,
    ValueError,
    SyntaxError,
    Image.DecompressionBombError,
)


def _problem(exc: BaseException) -> str:
    if isinstance(exc, Image.DecompressionBombError):
        pixels = re.search(r"\((\d+) pixels\)", str(exc))
        count = f"{int(pixels[1]):,} pixels" if pixels else "too many pixels"
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        return f"{count}, over Pillow's decompression-bomb limit of {limit:,}"
    return str(exc).split("\n")[0] or type(exc).__name__


_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) of an opened image once turned upright as its EXIF orientation
    says, from its header alone."""
    width, height = image.size
    if image.getexif().get(0x0112) in _ROTATED:
        width, height = height, width
    return height, width


def open_image(path: str, at_least: int | None = None) -> Image.Image:
    """``Image.open``; with ``at_least``, a JPEG is set to decode at the smallest of 1/1,
    1/2, 1/4, 1/8 scale (in the DCT, far cheaper than decoding it whole) that keeps both
    sides at least that many pixels — for uses that shrink it to that size anyway, which
    then all see the same pixels: a 400x300 JPEG for 64-pixel evaluation (short side 73)
    decodes at 100x75, 0.9 instead of 1.5 ms with the resize."""
    image = Image.open(path)
    if at_least:
        image.draft(image.mode, (at_least, at_least))
    return image


def read_rgb(path: str, at_least: int | None = None) -> tuple[Image.Image | None, str | None]:
    """The image, upright 3-channel RGB, or None and why it cannot be used."""
    try:
        if os.path.getsize(path) == 0:
            return None, "empty file"
        with open_image(path, at_least) as image:
            image.load()
            return to_rgb(image), None
    except IMAGE_ERRORS as exc:
        return None, _problem(exc)


def load_rgb(path: str, at_least: int | None = None) -> Image.Image:
    """Open an image as upright 3-channel RGB; an unreadable file is a UserError."""
    image, problem = read_rgb(path, at_least)
    if image is None:
        raise UserError(f"cannot read image {path}: {problem}")
    return image


def image_problem(path: str) -> str | None:
    """Why ``path`` cannot be used as an image (all of it decoded), or None when it can.

    A JPEG is decoded at 1/8 scale: every byte is still read and entropy-decoded, so a
    truncated or corrupt file fails alike (checked), in two thirds of the time."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file"
        with open_image(path, at_least=1) as image:
            image.load()
        return None
    except IMAGE_ERRORS as exc:
        return _problem(exc)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run with torch's CPU generator seeded, then put its state back (microseconds,
    unlike torch.random.fork_rng, which also visits CUDA)."""
    generator = torch.default_generator
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(saved)


class ImageSamples(Dataset):
    """(path, label) pairs read with PIL and passed through a transform; ``at_least``:
    the transform shrinks the short side to that first (see ``open_image``)."""

    def __init__(
        self,
        samples: Sequence[Sample],
        transform: Callable | None = None,
        at_least: int | None = None,
    ):
        self.samples = list(samples)
        self.transform = transform
        self.at_least = at_least

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> Image.Image | torch.Tensor:
        """The sample's image, decoded (at reduced scale where ``at_least`` allows); a
        subclass may give its pixels as a uint8 tensor instead."""
        return load_rgb(self.samples[index][0], self.at_least)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, int]:
        """``key`` is an index, or (index, seed) from the training sampler: then the random
        transform is seeded per sample, so augmentation is reproducible anywhere."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.load(index), self.samples[index][1]
        if self.transform is None:
            return image, label
        if seed is None:
            return self.transform(image), label
        with seeded(seed):
            return self.transform(image), label
