"""Where training images are augmented: in a loader process on the CPU, or on the model's
device (--augment-on), per batch, from the decoded cache.

Generates a folder of 400x300 JPEGs, caches it (raw pixels), then times one batch of
random-resized crops, flips and normalisation both ways, in alternating rounds:

* loader: one loader process's work for a batch (``CachedImages``, one thread); with W
  workers the loader delivers about W times that;
* device: the loader's share (reading the cached pixels, drawing the boxes) and the
  training process's share (``DeviceBatch.on``: copy, crop, resize, flip, normalise on
  the device, synchronised), which runs on the training process's one CPU thread between
  the steps it launches.

Run at N and 8N images per batch to see how each grows. On a GPU machine:

    python benchmarks/augment_where.py --device cuda --image-size 224 --batch 32 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages
from paratrain.data.device_batches import DeviceAugmented
from paratrain.data.folder import build_split
from paratrain.data.transforms import TrainAugment

sys.path.insert(0, str(Path(__file__).parent))
from vs_plain_loop import make_folder  # noqa: E402


def _timed(work, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(split, cache, size: int, batch: int, device: torch.device, rounds: int) -> dict:
    """Median seconds per batch: the loader path, and the device path's two shares."""
    augment = TrainAugment(size)
    on_cpu = CachedImages(split.train, cache, augment)
    on_device = DeviceAugmented(split.train, augment, cache)
    keys = [(i % len(split.train), 7919 * i) for i in range(batch)]
    loader, reading, device_side = [], [], []
    for _ in range(rounds):
        loader.append(_timed(lambda: on_cpu.__getitems__(keys), torch.device("cpu")))
        start = time.perf_counter()
        pending, _ = on_device.__getitems__(keys)
        pending = pending.pin_memory() if device.type == "cuda" else pending
        reading.append(time.perf_counter() - start)
        device_side.append(
            _timed(lambda: pending.on(device, torch.channels_last), device)  # noqa: B023
        )
    return {
        "loader": statistics.median(loader[1:]),
        "reading": statistics.median(reading[1:]),
        "device": statistics.median(device_side[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one loader process's thread, and the training process's
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        make_folder(Path(tmp) / "data", args.images)
        split = build_split(Path(tmp) / "data")
        cache = prepare(split.train, args.image_size, "on", 8.0, str(Path(tmp) / "c"), workers=0)
        print(f"{args.image_size} px from the raw cache, device {device}, one CPU thread")
        print(
            f"{'batch':>6} {'loader ms':>10} {'img/s':>7} | {'read ms':>8} {'on-device ms':>13} {'img/s':>7}"
        )
        for batch in args.batch:
            t = measure(split, cache, args.image_size, batch, device, args.rounds)
            print(
                f"{batch:>6} {t['loader'] * 1e3:>10.1f} {batch / t['loader']:>7.0f} | "
                f"{t['reading'] * 1e3:>8.1f} {t['device'] * 1e3:>13.1f} {batch / t['device']:>7.0f}"
            )


if __name__ == "__main__":
    main()
