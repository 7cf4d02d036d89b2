"""Loader throughput: decoding JPEGs every epoch vs the decoded-image cache.

Generates a folder of 3,000 JPEGs of about 400x300 pixels (5 classes), builds both kinds
of cache (raw pixels and packed JPEG; build times and sizes printed), then times the
training loader alone — decode path and each cache, same sampler, batch and image size,
one process and one thread, no loader workers, so the figure is per core — in
alternating rounds. Targets: raw >= 5x, packed >= 3x the decode path.

    python benchmarks/loader_cache.py [--images 3000] [--image-size 224] [--measure 600]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from paratrain.data import jpeg
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages
from paratrain.data.folder import build_split
from paratrain.data.samplers import TrainSampler
from paratrain.data.transforms import DecodedSamples, TrainAugment, batched


def photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Smooth colour fields with texture: compresses and decodes like a photograph."""
    yy, xx = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 6.28, size=3)
    pixels = np.stack(
        [127 + 100 * np.sin(xx / (20 + 7 * c) + yy / 31 + phase[c]) for c in range(3)], -1
    )
    pixels += rng.normal(0, 12, size=pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_jpegs(
    root: Path, count: int, classes: int = 5, size: tuple[int, int] = (300, 400)
) -> Path:
    """``count`` photo-like JPEGs (height, width ``size``, quality 90) in ``classes``
    class folders."""
    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"class_{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(photo(rng, *size)).save(folder / f"{i:05d}.jpg", quality=90)
    return root


def images_per_second(dataset, count: int, batch: int) -> float:
    sampler = TrainSampler(len(dataset), 0, 1, seed=0)
    extra = {"collate_fn": batched}
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=0, **extra)
    seen, start = 0, time.perf_counter()
    for images, _ in loader:
        seen += images.shape[0]
        if seen >= count:
            break
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--measure", type=int, default=600, help="images timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--original", default="300x400", help="originals' HEIGHTxWIDTH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        height, width = (int(v) for v in args.original.split("x"))
        split = build_split(make_jpegs(root / "data", args.images, size=(height, width)))
        print(
            f"generated {args.images} JPEGs in {time.perf_counter() - start:.1f}s", file=sys.stderr
        )
        everything = split.train + split.val
        builds, sets = {}, {"decode": DecodedSamples(split.train, TrainAugment(args.image_size))}
        for kind in ("raw", "packed"):
            start = time.perf_counter()
            cache = prepare(everything, args.image_size, kind, 100.0, str(root / "c"), workers=0)
            builds[kind] = (time.perf_counter() - start, cache.nbytes)
            sets[kind] = CachedImages(split.train, cache, TrainAugment(args.image_size))
        rates: dict[str, list[float]] = {name: [] for name in sets}
        for _ in range(args.rounds):  # alternating rounds: drift hits every path alike
            for name, dataset in sets.items():
                rates[name].append(images_per_second(dataset, args.measure, 32))
    median = {name: statistics.median(found) for name, found in rates.items()}
    print(
        f"{args.images} JPEGs {width}x{height}, image size {args.image_size}, 1 process, 1 thread, "
        f"no workers; decoder {jpeg.DECODER}"
    )
    for kind, (seconds, nbytes) in builds.items():
        print(
            f"  {kind} cache build: {seconds:.1f}s ({len(everything) / seconds:.0f} img/s), "
            f"{nbytes / 2**20:.0f} MiB"
        )
    for name, rate in median.items():
        ratio = rate / median["decode"]
        print(f"  {name + ' path:':<13}{rate:8.1f} img/s  {ratio:5.2f}x decoding the originals")
    print("  targets: raw >= 5x, packed >= 3x")


if __name__ == "__main__":
    main()
