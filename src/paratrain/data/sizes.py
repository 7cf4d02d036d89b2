"""The training size a folder's own images suggest (config's "small images" preset).

Without --image-size a run trains at 224 px, ImageNet's size; a folder of 64-pixel
images would then be upsampled 3.5x and train about 3x slower for nothing. The headers
of a few images spread over the classes (no pixel is decoded) give the median short
side; a folder whose images are smaller than the default trains near it.

Such a folder's training crops are also cut as small-image recipes (CIFAR's) cut them:
``SMALL_CROP_KIND``, a square of the training size at a random place, at the scale
validation sees the image, so that a pattern a pixel wide reaches training as
validation will see it, not resampled. Chosen on the choose half of the suite of
docs/benchmarks.md (seeds 0 and 1, equal epochs): the final top-1 of the three sets
rose by 1.2 points in the mean (texture +2.2, 50 classes +1.9, colour -0.5) and the
first epoch's in each. With ``--crop resized`` the crops stay milder than ImageNet's:
RandomResizedCrop keeps at least ``SMALL_CROP`` of an image's area, not 8%; an 8% crop
of a 96x128 image is about 30 pixels a side, blown up to the training size.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from paratrain.data.sources.base import is_image, is_junk, names_a_source

SAMPLE = 64  # image headers read, spread over the classes
DEFAULT = 224  # TrainConfig's image_size: larger images keep it
SMALLEST = 32
SMALL_CROP = 0.35  # --crop-scale-min for small images (torchvision's default: 0.08)
SMALL_CROP_KIND = "shifted"  # --crop for small images (torchvision's: resized)
LARGE = 2  # originals this many times the cached side or more are cached larger


def _class_folders(root: Path) -> list[Path]:
    top = root / "train" if (root / "train").is_dir() and (root / "val").is_dir() else root
    return sorted(p for p in top.iterdir() if p.is_dir() and not is_junk(p.name))


def _state(folder: str) -> tuple[tuple[str, int], ...]:
    """The class folders with their modification times, which an image added, removed
    or renamed changes: what the answers below are remembered by, besides the path, so
    that a process that trains twice sees the folder as it is (the time moves in the
    kernel's coarse ticks, a few milliseconds)."""
    try:
        return tuple((p.name, p.stat().st_mtime_ns) for p in _class_folders(Path(folder)))
    except OSError:
        return ()


def median_short_side(folder: str) -> tuple[int, int] | None:
    """(the median short side in pixels, how many headers were read) of up to
    ``SAMPLE`` images, the first few of each class by name; None where none reads."""
    return _median_short_side(folder, _state(folder))


@functools.lru_cache(maxsize=16)
def _median_short_side(folder: str, _times: tuple) -> tuple[int, int] | None:
    try:
        classes = _class_folders(Path(folder))
    except OSError:
        return None
    each = max(1, math.ceil(SAMPLE / max(len(classes), 1)))
    sides = []
    for class_folder in classes[:SAMPLE]:
        try:
            names = sorted(n for n in os.listdir(class_folder) if is_image(n) and not is_junk(n))
        except OSError:
            continue
        for name in names[:each]:
            try:
                with Image.open(class_folder / name) as image:  # the header alone
                    sides.append(min(image.size))
            except (OSError, UnidentifiedImageError, ValueError):
                continue  # the screen reports it, in its own words
    if not sides:
        return None
    sides.sort()
    return sides[len(sides) // 2], len(sides)


def _folder(values: Mapping[str, Any]) -> str | None:
    data = values.get("data")
    if not isinstance(data, str) or names_a_source(data):
        return None
    path = Path(data).expanduser()
    return str(path.resolve()) if path.is_dir() else None


def suggested_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """{"image_size": near the median short side, a multiple of 8, at least 32, "crop":
    SMALL_CROP_KIND and "crop_scale_min": SMALL_CROP (for --crop resized)} for a local
    folder of images smaller than the default; {} otherwise."""
    folder = _folder(values)
    found = median_short_side(folder) if folder else None
    if found is None:
        return {}
    size = max(SMALLEST, 8 * round(found[0] / 8))
    if size >= DEFAULT:
        return {}
    return {"image_size": size, "crop": SMALL_CROP_KIND, "crop_scale_min": SMALL_CROP}


def _image_count(folder: str) -> int:
    """The images in the folder's class folders, by name (nothing opened; listed once
    while the folder stays as it is: the rule is asked again for the run's first line)."""
    return _counted(folder, _state(folder))


@functools.lru_cache(maxsize=16)
def _counted(folder: str, _times: tuple) -> int:
    count = 0
    for class_folder in _class_folders(Path(folder)):
        try:
            count += sum(1 for n in os.listdir(class_folder) if is_image(n) and not is_junk(n))
        except OSError:
            continue
    return count


def larger_cache(values: Mapping[str, Any]) -> dict[str, Any]:
    """{"cache_side": the short side at which the smallest training crop still holds the
    training size, no more than the median original's} for a local folder of images
    ``LARGE`` times the side the cache keeps by default (validation's resize) or more,
    where raw pixels at that side fit --cache-max-gb; {} otherwise. A crop of 8% of a
    73-px image is cut from about 20 pixels a side and blown up to 64; of a 360-px
    original, from 100."""
    from paratrain.config.train import TrainConfig

    folder = _folder(values)
    found = median_short_side(folder) if folder else None
    if found is None or values.get("progressive"):
        return {}
    without = TrainConfig(**{**values, "cache_side": None})  # the sizes as the run has them
    size, kept = without.train_size, without.stored_size  # kept: what the cache holds anyway
    small = suggested_settings(values)
    if (values.get("crop") or small.get("crop")) == "shifted":
        return {}  # crops at validation's scale: what the cache keeps already
    scale = values.get("crop_scale_min") or small.get("crop_scale_min", without.crop_scale_min)
    if found[0] < LARGE * kept:
        return {}  # the cache keeps most of what the originals hold
    side = min(found[0], math.ceil(size / math.sqrt(scale)))
    if side <= kept:
        return {}
    assert folder is not None
    budget = float(values.get("cache_max_gb") or 4.0) * 2**30
    return {"cache_side": side} if _image_count(folder) * side * side * 4 <= budget else {}


def why_larger(values: Mapping[str, Any]) -> str:
    """The start line's words for the larger cache."""
    folder = _folder(values)
    median, read = median_short_side(folder) or (0, 0) if folder else (0, 0)
    side = values.get("cache_side") or larger_cache(values).get("cache_side")
    return (
        f"--data's images are large ({median} px on the short side, the median of {read}): "
        f"the cache keeps them at {side} px, not at validation's resize, so that the "
        "smallest training crop is cut from as many pixels as it shows (its raw pixels fit "
        "--cache-max-gb)"
    )


def why(values: Mapping[str, Any]) -> str:
    """The start line's words for the preset."""
    folder = _folder(values)
    found = median_short_side(folder) if folder else None
    median, read = found if found else (0, 0)
    return (
        f"--data's images are small ({median} px on the short side, the median of {read}; "
        f"--image-size {DEFAULT} trains at the default; crops are squares of the training "
        f"size shifted at validation's scale, not resized; --crop resized keeps at least "
        f"{SMALL_CROP:.0%} of an image)"
    )
