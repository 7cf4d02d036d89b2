"""What every cache kind shares: the ``CacheKind`` interface each kind's module declares,
the cache's key, and the decode that fills every kind (as evaluation decodes: a JPEG at
reduced scale where it stays large enough, then the eval transform's own Resize, so
that the shorter side is what the transforms need).

The folder's name is a hash of the format, the kind, the stored size and every entry's
key, size and modification time (data/samples.py), so changed data builds a new cache.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torchvision import transforms as T
from tqdm import tqdm

from paratrain.data.builtin import default_cache_dir
from paratrain.data.cache import KINDS
from paratrain.data.folder import IMAGE_ERRORS, open_image, read_rgb, upright_size
from paratrain.data.samples import Samples
from paratrain.data.transforms import INTERPOLATION, resized_size

CACHE_FORMAT = 5  # 4: manifest with checksums; 5: kinds (raw, packed), parts, keyed entries
MANIFEST = "manifest.json"  # written last: a cache without a valid one is not a cache
BLOCK = 64 * 2**20  # bytes a checksum covers
SIZING_SAMPLE = 2000  # headers read to estimate a large data set's decoded size


@dataclass(frozen=True)
class Sizing:
    """What choosing a kind knows: the entries, the stored short side, the bytes of their
    raw pixels (counted, with every shape in ``exact``, for small sets; else estimated
    from SIZING_SAMPLE headers), the --cache-max-gb budget and the disk's free bytes."""

    samples: Samples
    short: int
    raw_bytes: int
    exact: np.ndarray | None
    max_gb: float
    free: int
    asked: bool  # the kind was named (--cache KIND): no budget applies
    interpolation: str = "bilinear"

    @property
    def budget(self) -> float:
        return self.max_gb * 2**30


class Stored:
    """A build's writer for one kind, in the process that decodes: ``store`` keeps one
    entry's pixels and returns what goes back to the rank (None: nothing)."""

    def store(self, i: int, pixels: np.ndarray) -> tuple[str | None, Any]:
        raise NotImplementedError


class Collected:
    """A build's writer for one kind, in the rank: takes what ``Stored`` sent back."""

    def add(self, i: int, payload: Any) -> None:
        """Keep entry ``i``'s payload."""

    def close(self) -> None:
        """Everything this rank collected is on disk."""


class CacheKind:
    """One way of keeping decoded images; a module's ``KIND``."""

    name: str
    tag = "0"  # folded into the key besides the name (packed: its JPEG quality)
    lossless = True  # bit for bit the decode path's pixels: validation may read them
    encoded = False  # entries are compressed bytes (the device path decodes them there)
    in_auto = True  # --cache auto may take it

    def manifest_fields(self) -> dict:
        """What the manifest records of this kind besides the common fields."""
        return {}

    def part_names(self, directory: Path) -> list[str]:
        """The data files of a built (or building) cache."""
        raise NotImplementedError

    def size(self, sizing: Sizing) -> tuple[int, np.ndarray | None]:
        """The bytes this kind would take, and every entry's stored shape where counted."""
        raise NotImplementedError

    def refuses(self, nbytes: int, sizing: Sizing) -> str | None:
        """Why ``--cache auto`` passes this kind over (None: it fits)."""
        raise NotImplementedError

    def chosen(self, nbytes: int, sizing: Sizing) -> str:
        """What ``--cache auto`` says when it takes this kind."""
        raise NotImplementedError

    def lay_out(self, tmp: Path, shapes: np.ndarray | None, nbytes: int) -> str | None:
        """Before the build, in its temporary folder: why it cannot start (None: ready)."""
        return None

    def stored(self, directory: Path) -> Stored:
        raise NotImplementedError

    def collected(self, directory: Path, local_rank: int) -> Collected:
        return Collected()

    def finish(self, tmp: Path, images: int) -> None:
        """The node's builder, once every rank is done: the index made whole."""

    def pixels(self, stored: np.ndarray, height: int, width: int) -> np.ndarray:
        """An entry's HWC uint8 pixels from its stored bytes."""
        raise NotImplementedError


def kind(name: str) -> CacheKind:
    """The registered kind ``name`` (its module's ``KIND``)."""
    if name not in KINDS:
        raise KeyError(f"no cache kind {name!r} (kinds: {', '.join(KINDS)})")
    declared: CacheKind = importlib.import_module(f"paratrain.data.cache.{name}").KIND
    return declared


def kinds_for(mode: str) -> list[str]:
    """The kinds a --cache mode may build: the one named ('on' is the first), or every
    kind in the registry's order (auto)."""
    if mode == "auto":
        return [name for name in KINDS if kind(name).in_auto]
    return [next(iter(KINDS))] if mode == "on" else [mode]


def cache_key(
    samples: Samples, short_side: int, kind_name: str, interpolation: str = "bilinear"
) -> str:
    """The cache's name: a hash of the format, the kind, the stored size and its
    resizing, and every entry's key, size and modification time."""
    tag = kind(kind_name).tag
    resizing = "" if interpolation == "bilinear" else f"-{interpolation}"
    digest = hashlib.sha256(
        f"paratrain-cache-{CACHE_FORMAT}-{kind_name}-{short_side}-{tag}{resizing}".encode()
    )
    digest.update(samples.digest().encode())
    return digest.hexdigest()[:24]


def cache_base(root: str | None) -> Path:
    return (Path(root) if root else default_cache_dir()) / "decoded"


def stored_shape(samples: Samples, i: int, short_side: int) -> tuple[int, int]:
    """(height, width) of entry ``i`` once upright and resized, from its header alone."""
    with open_image(samples.keys[i], short_side, samples.source) as image:
        height, width = upright_size(image)
    return resized_size(height, width, short_side)


def shape_or_empty(samples: Samples, i: int, short: int) -> tuple[int, int]:
    """A file whose header cannot be read gets no room; the build reports why."""
    try:
        return stored_shape(samples, i, short)
    except IMAGE_ERRORS:
        return (0, 0)


def resized(
    samples: Samples, i: int, short: int, interpolation: str = "bilinear"
) -> tuple[np.ndarray | None, str | None]:
    """Entry ``i`` decoded and resized as the cache stores it (HWC uint8), or why not."""
    image, problem = read_rgb(samples.keys[i], short, samples.source)
    if image is None:
        return None, problem
    resize = T.Resize(short, interpolation=INTERPOLATION[interpolation], antialias=True)
    return np.asarray(resize(image), dtype=np.uint8), None


def sample_rows(n: int) -> np.ndarray:
    """Up to SIZING_SAMPLE entries spread evenly (all of them when fewer)."""
    if n <= SIZING_SAMPLE:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, SIZING_SAMPLE).astype(np.int64))


def shapes(samples: Samples, short: int, rows: np.ndarray | None = None) -> np.ndarray:
    """(height, width) as stored of ``rows`` (every entry by default), from headers."""
    rows = np.arange(len(samples)) if rows is None else rows
    bar = tqdm(
        rows.tolist(),
        desc="sizing image cache",
        unit="img",
        delay=1.0,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    return np.array([shape_or_empty(samples, i, short) for i in bar], np.int64).reshape(-1, 2)
