"""Where training images are augmented: in a loader process on the CPU, or on the model's
device (--augment-on), per batch, from the decoded cache.

Generates a folder of 400x300 JPEGs, caches it (raw pixels), then times one batch of
random-resized crops, flips and normalisation both ways, in alternating rounds:

* loader: one loader process's work for a batch (``CachedImages``, one thread); with W
  workers the loader delivers about W times that;
* device: the loader's share (reading the cached pixels into one padded batch, drawing
  the boxes) and the training process's share (``DeviceBatch.on``: one copy, then crop
  and resize of the whole batch in one roi_align, flip, normalise, synchronised), which
  runs on the training process's one CPU thread between the steps it launches;
* per image: the device path as it was, a few small kernels per image
  (``TrainAugment.apply`` image by image), for comparison;
* pixels: how far the batched path's pixels are from the per-image path's for the same
  boxes and flips (mean and largest absolute difference, in grey levels 0-255): the
  filters differ (roi_align's area average against an antialiased bilinear resize).

* dali (where NVIDIA DALI is installed): from the JPEG files, the loader's share (reading
  each file's bytes, drawing the boxes) and DALI's (decoding each crop's region,
  resizing, flipping), then torch's normalisation, synchronised.

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
from paratrain.data.device_batches import DeviceAugmented, DeviceBatch
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


def per_image(batch: DeviceBatch, device: torch.device) -> torch.Tensor:
    """The device path before it was batched: each image cropped, resized, flipped and
    normalised on its own (a few kernels each)."""
    out = torch.empty(len(batch), 3, batch.augment.size, batch.augment.size, device=device)
    rows = zip(out, batch.images, batch.boxes.tolist(), batch.flips.tolist(), strict=True)
    for slot, image, box, flip in rows:
        batch.augment.apply(image.to(device, non_blocking=True), box, flip, slot)
    return out.contiguous(memory_format=torch.channels_last)


def measure(split, cache, size: int, batch: int, device: torch.device, rounds: int) -> dict:
    """Median seconds per batch: the loader path, the device path's two shares, the
    per-image device path; and the pixel difference between the batched and per-image
    paths."""
    augment = TrainAugment(size)
    on_cpu = CachedImages(split.train, cache, augment)
    on_device = DeviceAugmented(split.train, augment, cache)
    keys = [(i % len(split.train), 7919 * i) for i in range(batch)]
    loader, reading, device_side, single = [], [], [], []
    for _ in range(rounds):
        loader.append(_timed(lambda: on_cpu.__getitems__(keys), torch.device("cpu")))
        start = time.perf_counter()
        pending, _ = on_device.__getitems__(keys)
        pending = pending.pin_memory() if device.type == "cuda" else pending
        reading.append(time.perf_counter() - start)
        device_side.append(
            _timed(lambda: pending.on(device, torch.channels_last), device)  # noqa: B023
        )
        single.append(_timed(lambda: per_image(pending, device), device))  # noqa: B023
    grey = torch.tensor(augment_std()).view(1, 3, 1, 1).mul(255).to(device)
    gap = ((pending.on(device, torch.channels_last) - per_image(pending, device)) * grey).abs()
    return {
        "loader": statistics.median(loader[1:]),
        "reading": statistics.median(reading[1:]),
        "device": statistics.median(device_side[1:]),
        "per_image": statistics.median(single[1:]),
        "mean_gap": float(gap.mean()),
        "max_gap": float(gap.max()),
    }


def measure_dali(split, size: int, batch: int, device: torch.device, rounds: int) -> str:
    """DALI's way from the JPEG files, in words: read ms, DALI ms, images/s."""
    from paratrain.data import dali

    why = dali.available()
    if why is not None:
        return f"not measured: {why}"
    reader = DeviceAugmented(split.train, TrainAugment(size), None, dali=True)
    keys = [(i % len(split.train), 7919 * i) for i in range(batch)]
    reading, augmenting = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        pending, _ = reader.__getitems__(keys)
        reading.append(time.perf_counter() - start)
        augmenting.append(_timed(lambda: pending.on(device, torch.channels_last), device))  # noqa: B023
    read, made = statistics.median(reading[1:]), statistics.median(augmenting[1:])
    return f"read {read * 1e3:.1f} ms + DALI {made * 1e3:.1f} ms, {batch / made:.0f} img/s"


def augment_std() -> tuple[float, float, float]:
    from paratrain.data.transforms import IMAGENET_STD

    return IMAGENET_STD


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
            f"{'batch':>6} {'loader ms':>10} {'img/s':>7} | {'read ms':>8} {'batched ms':>11} "
            f"{'img/s':>7} | {'per-image ms':>13} {'img/s':>7} | {'pixels: mean':>13} {'max':>5}"
        )
        for batch in args.batch:
            t = measure(split, cache, args.image_size, batch, device, args.rounds)
            dali = measure_dali(split, args.image_size, batch, device, args.rounds)
            print(
                f"{batch:>6} {t['loader'] * 1e3:>10.1f} {batch / t['loader']:>7.0f} | "
                f"{t['reading'] * 1e3:>8.1f} {t['device'] * 1e3:>11.1f} "
                f"{batch / t['device']:>7.0f} | {t['per_image'] * 1e3:>13.1f} "
                f"{batch / t['per_image']:>7.0f} | {t['mean_gap']:>13.2f} {t['max_gap']:>5.0f}"
            )
            print(f"{'':>6} dali: {dali}")


if __name__ == "__main__":
    main()
