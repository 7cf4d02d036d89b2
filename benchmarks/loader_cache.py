"""Loader throughput: decoding JPEGs every epoch vs the decoded-image cache.

Generates a folder of 3,000 JPEGs of about 400x300 pixels (5 classes), builds the cache
(its build time is printed), then times the training loader alone — decode path and
cache path, same sampler, batch and image size, one process and one thread, no loader
workers, so the figure is per core — in alternating rounds. Target: cache >= 5x.

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

from paratrain.data.cache import CachedImages, prepare
from paratrain.data.folder import build_split
from paratrain.data.samplers import TrainSampler
from paratrain.data.transforms import DecodedSamples, TrainAugment, batched


def make_jpegs(root: Path, count: int, classes: int = 5) -> Path:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:300, 0:400]
    for i in range(count):
        folder = root / f"class_{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        # smooth colour fields with texture: compresses and decodes like a photograph
        phase = rng.uniform(0, 6.28, size=3)
        pixels = np.stack(
            [127 + 100 * np.sin(xx / (20 + 7 * c) + yy / 31 + phase[c]) for c in range(3)], -1
        )
        pixels += rng.normal(0, 12, size=pixels.shape)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
            folder / f"{i:05d}.jpg", quality=90
        )
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        split = build_split(make_jpegs(root / "data", args.images))
        print(
            f"generated {args.images} JPEGs in {time.perf_counter() - start:.1f}s", file=sys.stderr
        )
        everything = split.train + split.val
        start = time.perf_counter()
        cache = prepare(everything, args.image_size, "on", 100.0, str(root / "cache"), workers=0)
        build = time.perf_counter() - start
        decode_set = DecodedSamples(split.train, TrainAugment(args.image_size))
        cache_set = CachedImages(split.train, cache, TrainAugment(args.image_size))
        rates = {"decode": [], "cache": []}
        for _ in range(args.rounds):
            rates["decode"].append(images_per_second(decode_set, args.measure, 32))
            rates["cache"].append(images_per_second(cache_set, args.measure, 32))
    decode, cached = statistics.median(rates["decode"]), statistics.median(rates["cache"])
    print(
        f"{args.images} JPEGs ~400x300, image size {args.image_size}, 1 process, 1 thread, no workers"
    )
    print(
        f"  cache build: {build:.1f}s ({len(everything) / build:.0f} img/s), {cache.nbytes / 2**20:.0f} MiB"
    )
    print(f"  decode path: {decode:8.1f} img/s")
    print(f"  cache path:  {cached:8.1f} img/s")
    print(f"  ratio {cached / decode:.2f}x (target >= 5x)")


if __name__ == "__main__":
    main()
