"""How start-up, feeding and memory grow with the data: N, 8N and 64N images.

Makes a folder of N x scale entries for each scale (5 classes; hard links to a few
thousand generated photo-like 400x300 JPEGs, so 1.28 million entries cost no disk), then
per size:

* listing + screen on a first start (nothing known) and on a second (the screen's
  verdicts kept), in this process with 2 screening workers;
* time to the first step of `paratrain train` (ResNet-18 at --image-size, one process,
  --cache off, the verdicts kept from before), from the command to its "first step"
  line, the median of --repeats starts;
* at N only (a per-core rate does not depend on the size): images/s one core feeds from
  each cache mode — decoding the originals, raw pixels, packed JPEG (on a subset);
* at the largest size: the RSS of the rank and of each of 2 loader workers at the start
  and at the end of a whole epoch (the decode path over 64x48 copies of the images at
  --rss-size px, so an epoch of 1.28 million entries takes minutes), for paratrain's
  array-backed samples and, for comparison, a Python list of (path, label) tuples.

    python benchmarks/data_scale.py [--n 20000] [--scales 1,8,64] [--root /tmp/data-scale]

Targets (2 cores): second start to first step at 64N within 3x of N and under 60 s at
1.28 million; worker RSS growth under 10% over the epoch; packed >= 3x the decode path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))
from _machine import machine  # noqa: E402
from loader_cache import images_per_second, make_jpegs  # noqa: E402

from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages  # noqa: E402
from paratrain.data.folder import build_split, load_rgb  # noqa: E402
from paratrain.data.samplers import TrainBatches, TrainSampler  # noqa: E402
from paratrain.data.scan import screened  # noqa: E402
from paratrain.data.transforms import DecodedSamples, TrainAugment, batched, to_chw  # noqa: E402

CLASSES = 5


def linked_tree(root: Path, base: Path, entries: int) -> Path:
    """``entries`` hard links to the JPEGs under ``base``, spread over the classes."""
    done = root / ".complete"
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    sources = sorted(str(p) for p in base.rglob("*.jpg"))
    folders = [root / f"class_{c}" for c in range(CLASSES)]
    for folder in folders:
        folder.mkdir(parents=True)
    for i in range(entries):
        os.link(sources[i % len(sources)], folders[i % CLASSES] / f"{i:07d}.jpg")
    done.touch()
    return root


def start_once(data: Path, memory: Path, workers: int = 2) -> tuple[float, float, int]:
    """(listing seconds, screen seconds, entries) of one start in this process."""
    start = time.perf_counter()
    split = build_split(data)
    listed = time.perf_counter() - start
    start = time.perf_counter()
    screened(split.train + split.val, 0, 1, workers, memory)
    return listed, time.perf_counter() - start, len(split.train) + len(split.val)


def first_step(data: Path, cache_dir: Path, runs: Path, image_size: int) -> float:
    """Seconds from launching `paratrain train` to its "first step" line (then stopped)."""
    command = [sys.executable, "-m", "paratrain", "train", "--data", str(data)]
    command += ["--model", "resnet18", "--image-size", str(image_size), "--batch-size", "16"]
    command += ["--cache", "off", "--cache-dir", str(cache_dir), "--output-dir", str(runs)]
    command += ["--epochs", "1", "--nproc", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PARATRAIN_STARTED", None)
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("first step"):
            seconds = time.time() - start
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return seconds
    proc.wait()
    raise RuntimeError("the run ended before its first step:\n" + "".join(lines[-20:]))


def memory_of(pid: int) -> tuple[float, float]:
    """(RSS, private dirty) of a process in MiB, from /proc/<pid>/smaps_rollup."""
    found = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        found[name] = int(value.split()[0]) / 1024
    return found["Rss"], found["Private_Dirty"]


class ListSamples(Dataset):
    """The same decode path over a Python list of (path, label) tuples: what each
    loader worker copies page by page as it reads it (pytorch/pytorch#13246)."""

    def __init__(self, pairs: list[tuple[str, int]], augment: TrainAugment):
        self.pairs, self.augment = pairs, augment

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitems__(self, keys: list) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.empty(len(keys), 3, self.augment.size, self.augment.size)
        labels = []
        for slot, (index, seed) in zip(batch, keys, strict=True):
            path, label = self.pairs[index]
            self.augment.sample(to_chw(load_rgb(path)), seed, out=slot)
            labels.append(label)
        return batch, torch.tensor(labels)


def epoch_memory(dataset, workers: int = 2, batch: int = 256) -> dict:
    """RSS of the rank and its workers after the first batch and after the last."""
    loader = DataLoader(dataset, batch_sampler=TrainBatches(TrainSampler(len(dataset), 0, 1), batch),
                        num_workers=workers, collate_fn=batched)  # fmt: skip
    batches = iter(loader)
    next(batches)
    pids = [w.pid for w in batches._workers]  # type: ignore[attr-defined]
    start = {
        "rank": memory_of(os.getpid()),
        **{f"worker {i}": memory_of(p) for i, p in enumerate(pids)},
    }
    began = time.perf_counter()
    for _ in batches:
        last = {
            "rank": memory_of(os.getpid()),
            **{f"worker {i}": memory_of(p) for i, p in enumerate(pids)},
        }
    seconds = time.perf_counter() - began
    return {"start": start, "end": last, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--scales", default="1,8,64")
    parser.add_argument("--distinct", type=int, default=3000, help="JPEGs the links point to")
    parser.add_argument("--root", default="/tmp/data-scale")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--feed", type=int, default=1500, help="images of the feed subset")
    parser.add_argument("--rss-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="starts timed per size")
    parser.add_argument("--skip", default="", help="phases to skip: start,step,feed,rss")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    root = Path(args.root)
    scales = [int(s) for s in args.scales.split(",")]
    print(f"{machine()}; N = {args.n}; root {root}", flush=True)
    base = root / "base"
    if not (base / ".complete").exists():
        shutil.rmtree(base, ignore_errors=True)
        make_jpegs(base, args.distinct, CLASSES)
        (base / ".complete").touch()
    results: dict = {"n": args.n, "sizes": {}}
    for scale in scales:
        entries = args.n * scale
        began = time.perf_counter()
        data = linked_tree(root / f"x{scale}", base, entries)
        row: dict = {"entries": entries, "made_s": time.perf_counter() - began}
        memory = root / f"memory-x{scale}"
        if "start" not in skip:
            shutil.rmtree(memory / "screened", ignore_errors=True)
            row["first_listing_s"], row["first_screen_s"], _ = start_once(data, memory)
            row["second_listing_s"], row["second_screen_s"], _ = start_once(data, memory)
        if "step" not in skip:
            if "start" in skip:  # the verdicts must be kept for a second start
                start_once(data, memory)
            runs = root / f"runs-x{scale}"
            times = [first_step(data, memory, runs, args.image_size) for _ in range(args.repeats)]
            row["first_step_s"] = float(np.median(times))
            row["first_step_each_s"] = times
            shutil.rmtree(runs, ignore_errors=True)
        results["sizes"][scale] = row
        print(json.dumps({f"x{scale}": row}), flush=True)
    if "feed" not in skip:
        subset = root / "feed"
        split = build_split(linked_tree(subset, base, args.feed), val_fraction=0.01)
        augment = TrainAugment(args.image_size)
        sets = {"decode": DecodedSamples(split.train, augment)}
        for kind in ("raw", "packed"):
            cache = prepare(
                split.train, args.image_size, kind, 100.0, str(root / "feed-cache"), workers=2
            )
            sets[kind] = CachedImages(split.train, cache, augment)
        torch.set_num_threads(1)
        rates: dict[str, list[float]] = {name: [] for name in sets}
        for _ in range(3):
            for name, dataset in sets.items():
                rates[name].append(images_per_second(dataset, 600, 32))
        results["feed"] = {name: float(np.median(found)) for name, found in rates.items()}
        print(json.dumps({"feed": results["feed"]}), flush=True)
    if "rss" not in skip:
        largest = max(scales)
        small = root / "base-small"
        if not (small / ".complete").exists():
            shutil.rmtree(small, ignore_errors=True)
            make_jpegs(small, args.distinct, CLASSES, size=(48, 64))
            (small / ".complete").touch()
        tree = linked_tree(root / f"small-x{largest}", small, args.n * largest)
        split = build_split(tree, val_fraction=0.01)
        augment = TrainAugment(args.rss_size)
        results["rss"] = {
            "arrays": epoch_memory(DecodedSamples(split.train, augment)),
            "python list": epoch_memory(ListSamples(list(split.train), augment)),
        }
        print(json.dumps({"rss": results["rss"]}), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
