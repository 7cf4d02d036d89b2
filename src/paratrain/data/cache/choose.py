"""Which cache a data set gets: a ready one (a kind whose folder passes the cheap checks),
one to build (the kind named, or under ``--cache auto`` the first kind in the registry's
order that fits: raw pixels within ``--cache-max-gb``, else packed JPEG where the disk
has room), or none, and why. Nothing is written here.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.data.cache.base import (
    Sizing,
    cache_base,
    cache_key,
    kind,
    kinds_for,
    sample_rows,
    shapes,
)
from paratrain.data.cache.read import DecodedCache
from paratrain.data.cache.verify import verify
from paratrain.data.samples import Samples, as_samples
from paratrain.data.transforms import eval_resize


@dataclass
class CachePlan:
    """What the cache of a data set would do: be read ("ready"), be built ("build"), or
    be left out ("skip", with the reason); ``kind``: which."""

    action: str
    directory: Path | None
    nbytes: int
    reason: str = ""
    shapes: np.ndarray | None = None  # (height, width) of every image, where counted
    kind: str = ""


def ready(samples: Samples, short: int, mode: str, base: Path, interpolation: str) -> dict:
    """{kind: what is wrong with its folder (None: nothing)} of the kinds ``mode`` may
    use whose folder exists, in the order tried."""
    found = {}
    for name in kinds_for(mode):
        directory = base / cache_key(samples, short, name, interpolation)
        if directory.exists():
            found[name] = verify(directory, len(samples), short, name)
    return found


def raw_size(samples: Samples, short: int) -> tuple[int, np.ndarray | None]:
    """Bytes of raw pixels, counted (with every shape) for small sets, else estimated
    from the headers of SIZING_SAMPLE entries."""
    rows = sample_rows(len(samples))
    counted = shapes(samples, short, rows)
    total = int((counted[:, 0] * counted[:, 1] * 3).sum())
    if len(rows) == len(samples):
        return total, counted
    return int(total * len(samples) / max(len(rows), 1)), None


def existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (to ask its disk for free space)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def survey(
    samples: Samples | Sequence[tuple[str, int]],
    image_size: int,
    mode: str,
    max_gb: float,
    root: str | None,
    short: int | None = None,
    free: int | None = None,
    interpolation: str = "bilinear",
) -> CachePlan:
    """The plan for ``samples`` without writing anything; ``short``: the short side
    stored (default: what evaluation at ``image_size`` needs); ``free``: bytes the
    cache folder's disk has."""
    samples = as_samples(samples)
    short = short or eval_resize(image_size)
    base = cache_base(root)
    if mode == "off":
        return CachePlan("skip", None, 0, "--cache off")
    for name, problem in ready(samples, short, mode, base, interpolation).items():
        if problem is None:
            directory = base / cache_key(samples, short, name, interpolation)
            return CachePlan("ready", directory, DecodedCache(directory).nbytes, kind=name)
    raw_bytes, exact = raw_size(samples, short)
    if free is None:
        free = shutil.disk_usage(existing(base)).free
    sizing = Sizing(samples, short, raw_bytes, exact, max_gb, free, mode != "auto", interpolation)
    passed: list[str] = []
    plan = CachePlan("skip", None, 0)
    for name in kinds_for(mode):
        nbytes, counted = kind(name).size(sizing)
        directory = base / cache_key(samples, short, name, interpolation)
        plan = CachePlan("build", directory, nbytes, "", counted, kind=name)
        if sizing.asked:
            return plan
        why_not = kind(name).refuses(nbytes, sizing)
        if why_not is None:
            plan.reason = kind(name).chosen(nbytes, sizing)
            plan.reason += f" ({'; '.join(passed)})" if passed else ""
            return plan
        passed.append(why_not)
    plan.action, plan.reason = "skip", ", and ".join(passed) + "; decoding every epoch"
    return plan
