"""A source's entries split into train and val; images read and validated.

The split is the same on every rank and every run:

* where the source gives it (``DIR/train`` and ``DIR/val``; a dataset's splits;
  validation shards), as given;
* a folder ``DIR/<class>/*`` or a dataset without a validation split: the same fraction
  of every class to validation, drawn with a fixed seed per class;
* WebDataset shards without validation shards: each sample by a hash of its key and
  the seed (no node has to list the others' shards to know which side a sample is on).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset

from paratrain.data.samples import Origin, Samples
from paratrain.data.sources.base import Listing, Source, open_source
from paratrain.errors import UserError

Sample = tuple[str, int]


@dataclass(frozen=True)
class DataSplit:
    classes: list[str]
    train: Samples
    val: Samples
    layout: str  # "split" (split here) or "given" (by the source)
    root: str  # what --data said
    ignored: int = 0  # files without an image extension, left out
    missing: list[tuple[str, str]] = field(default_factory=list)  # unreadable at listing
    label_sets: np.ndarray | None = None  # several labels per image (data/label_sets.py)

    @property
    def multilabel(self) -> bool:
        """Several labels per image: a sample's label numbers its label set."""
        return self.label_sets is not None

    @property
    def source(self) -> Origin | None:
        return self.train.source

    def class_index(self) -> dict[str, str]:
        """index -> class name, as written to class_indices.json."""
        return {str(i): name for i, name in enumerate(self.classes)}


def build_split(
    data: str | Path | Source,
    val_fraction: float = 0.2,
    seed: int = 0,
    node: int = 0,
    nodes: int = 1,
) -> DataSplit:
    """The classes and the train/val samples of ``data`` (a folder, ``hf:NAME``,
    ``wds:PATTERN``, or a Source); a sharded source lists only this ``node``'s shards."""
    source = data if isinstance(data, Source) else open_source(str(data))
    listing = source.listing(node, nodes)
    return split_listing(listing, source, val_fraction, seed)


def split_listing(listing: Listing, source: Source, val_fraction: float, seed: int) -> DataSplit:
    """Train and val of a listing: as the source gives them, by a hash of the key for a
    sharded source, else the same fraction of each class, seeded."""
    is_val = validation_side(listing, source, val_fraction, seed)
    return DataSplit(
        classes=listing.classes,
        train=listing.samples.where(~is_val),
        val=listing.samples.where(is_val),
        layout=listing.layout,
        root=source.name,
        ignored=listing.ignored,
        missing=listing.missing,
        label_sets=listing.label_sets,
    )


def validation_side(listing: Listing, source: Source, val_fraction: float, seed: int) -> np.ndarray:
    """Which entries of the listing go to validation (a boolean array); a class too small
    to split is a UserError."""
    samples = listing.samples
    if listing.sides is not None:
        is_val = listing.sides == 1
    elif source.sharded:
        is_val = np.array([_hashed_side(key, seed, val_fraction) for key in samples.keys])
    elif listing.label_sets is not None:  # several labels an image: no class to stratify by
        if len(samples) < 2:
            raise UserError(f"{source.name} has {len(samples)} image; 2 are needed to split it")
        is_val = np.zeros(len(samples), dtype=bool)
        is_val[split_class(len(samples), val_fraction, seed)] = True
    else:
        is_val = np.zeros(len(samples), dtype=bool)
        for index, name in enumerate(listing.classes):
            members = np.flatnonzero(samples.labels == index)
            if len(members) < 2:
                raise UserError(
                    f"class {name!r} of {source.name} has {len(members)} image; at least 2 are "
                    "needed to split it into train and val"
                )
            is_val[members[split_class(len(members), val_fraction, seed + index)]] = True
    return is_val


def split_class(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which of a class's ``n`` images (in their listed order) go to validation: at least
    one on each side, drawn with ``seed``."""
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[:n_val])


def _hashed_side(key: str, seed: int, val_fraction: float) -> bool:
    """A sample's side from its key alone: validation for a ``val_fraction`` of keys."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


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


EXIF_ORIENTATION = 0x0112  # the EXIF tag; 1 (or none) is upright
_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) of an opened image once turned upright as its EXIF orientation
    says, from its header alone."""
    width, height = image.size
    if image.getexif().get(EXIF_ORIENTATION) in _ROTATED:
        width, height = height, width
    return height, width


def open_image(path: str, at_least: int | None = None, source: Origin | None = None) -> Image.Image:
    """``Image.open``; with ``at_least``, a JPEG is set to decode at the smallest of 1/1,
    1/2, 1/4, 1/8 scale (in the DCT, far cheaper than decoding it whole) that keeps both
    sides at least that many pixels — for uses that shrink it to that size anyway, which
    then all see the same pixels: a 400x300 JPEG for 64-pixel evaluation (short side 73)
    decodes at 100x75, 0.9 instead of 1.5 ms with the resize."""
    return _decoder(source.open(path) if source is not None else path, at_least)


def _decoder(opened: str | BinaryIO, at_least: int | None) -> Image.Image:
    image = Image.open(opened)
    if at_least:
        image.draft(image.mode, (at_least, at_least))
    return image


def _entry(path: str, source: Origin | None) -> tuple[str | BinaryIO, bool]:
    """The entry opened (a path, or a file object of its bytes), and whether it is empty
    (said as such rather than as an unidentified image)."""
    opened = source.open(path) if source is not None else path
    if isinstance(opened, str):
        return opened, os.path.getsize(opened) == 0
    if isinstance(opened, io.BytesIO):
        return opened, opened.getbuffer().nbytes == 0
    return opened, False


def read_rgb(
    path: str, at_least: int | None = None, source: Origin | None = None
) -> tuple[Image.Image | None, str | None]:
    """The image, upright 3-channel RGB, or None and why it cannot be used (``path``:
    a key of ``source``, else a file's path)."""
    try:
        opened, empty = _entry(path, source)
        if empty:
            return None, "empty file"
        with _decoder(opened, at_least) as image:
            image.load()
            return to_rgb(image), None
    except IMAGE_ERRORS as exc:
        return None, _problem(exc)


def load_rgb(path: str, at_least: int | None = None, source: Origin | None = None) -> Image.Image:
    """Open an image as upright 3-channel RGB; an unreadable file is a UserError."""
    image, problem = read_rgb(path, at_least, source)
    if image is None:
        raise UserError(f"cannot read image {path}: {problem}")
    return image


def image_problem(path: str, source: Origin | None = None) -> str | None:
    """Why ``path`` cannot be used as an image (all of it decoded), or None when it can.

    A JPEG is decoded at 1/8 scale: every byte is still read and entropy-decoded, so a
    truncated or corrupt file fails alike (checked), in two thirds of the time."""
    try:
        opened, empty = _entry(path, source)
        if empty:
            return "empty file"
        with _decoder(opened, 1) as image:
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
        samples: Samples | Sequence[Sample],
        transform: Callable | None = None,
        at_least: int | None = None,
    ):
        self.samples = samples if isinstance(samples, Samples) else Samples.of(samples)
        self.source = self.samples.source
        self.transform = transform
        self.at_least = at_least

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> Image.Image | torch.Tensor:
        """The sample's image, decoded (at reduced scale where ``at_least`` allows); a
        subclass may give its pixels as a uint8 tensor instead."""
        return load_rgb(self.samples.keys[index], self.at_least, self.source)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, int]:
        """``key`` is an index, or (index, seed) from the training sampler: then the random
        transform is seeded per sample, so augmentation is reproducible anywhere."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.load(index), int(self.samples.labels[index])
        if self.transform is None:
            return image, label
        if seed is None:
            return self.transform(image), label
        with seeded(seed):
            return self.transform(image), label


def leave_stop_signals_to_the_rank(_worker_id: int = 0) -> None:
    """A loader worker's worker_init_fn: SIGTERM, SIGUSR1 and SIGINT ignored. A
    cluster's preemption (scancel, timeout, --signal=USR1) and a terminal's Ctrl-C reach
    every process of the group; the rank acts on them (a step checkpoint, then exit),
    and its workers must not die first and turn that into a DataLoader error.

    Nor print a traceback when the rank, interrupted, breaks off taking a batch: a
    worker hands its tensors over through multiprocessing's resource sharer, whose
    thread reports any error on the connection through ``sys.excepthook``. A reset or
    closed connection there means the rank went away; the rank says why."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.excepthook = _quiet_when_the_rank_hangs_up(sys.excepthook)


def _quiet_when_the_rank_hangs_up(report: Callable[..., Any]) -> Callable[..., None]:
    def hook(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        if not issubclass(kind, ConnectionError | EOFError):
            report(kind, value, trace)

    return hook
