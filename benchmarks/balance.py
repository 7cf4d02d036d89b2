"""--balance on a generated set at 10:1: balanced accuracy with and without balancing.

The set: 5 classes of 40x40 colour patches, each class a mean colour along a line in
RGB with a per-image offset as wide as the step between classes (neighbours overlap:
where the boundary lies is learnt from how many of each the data holds), class 0 ten
times the others in training (``--major`` and ``--minor`` images), the validation split
balanced (``--val`` per class), so that balanced accuracy and macro-F1 say how well the
rare classes are learnt. Each mode (none, sampler, loss) trains the
same epochs from the same seed, in one process; every seed is a new set and a new run.
Printed: a markdown table of final validation balanced accuracy, top-1 and macro-F1,
the mean over seeds and the spread (max - min), and the machine.

    python benchmarks/balance.py [--seeds 0 1 2] [--epochs 6] [--size 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from vs_plain_loop import run  # noqa: E402

CLASSES = 5
MODES = ("none", "sampler", "loss")


def _image(rng: np.random.Generator, label: int) -> Image.Image:
    """A 40x40 patch whose colour says its class: the class's mean colour, a per-image
    offset as wide as the step between neighbouring classes (so neighbours overlap and
    the boundary between them is where the data puts it), and pixel noise."""
    mean = np.array([90.0, 120.0, 150.0]) + label * np.array([16.0, 9.0, -12.0])
    colour = mean + rng.normal(0, 11, 3)
    pixels = colour + rng.normal(0, 30, (40, 40, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_imbalanced(root: Path, seed: int, major: int, minor: int, val: int) -> Path:
    """``root/{train,val}/class_<k>/*.jpg``: class 0 ``major`` training images, the
    others ``minor``; ``val`` of every class in validation."""
    rng = np.random.default_rng(seed)
    for label in range(CLASSES):
        for subset, count in (("train", major if label == 0 else minor), ("val", val)):
            folder = root / subset / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                _image(rng, label).save(folder / f"{i:04d}.png")
    return root


def train(data: Path, mode: str, seed: int, args, cwd: Path) -> dict:
    command = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data), "--model", "resnet18",
        "--image-size", str(args.size), "--epochs", str(args.epochs), "--batch-size", "32",
        "--workers", "1", "--cache", "on", "--balance", mode, "--seed", str(seed),
        "--name", f"{mode}-{seed}", "--output-dir", str(cwd / "runs"),
    ]  # fmt: skip
    run(command, 2, cwd)
    rows = (cwd / "runs" / f"{mode}-{seed}" / "metrics.jsonl").read_text().splitlines()
    return json.loads(rows[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--major", type=int, default=400)
    parser.add_argument("--minor", type=int, default=40)
    parser.add_argument("--val", type=int, default=40)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as folder:
        cwd = Path(folder)
        for seed in args.seeds:
            data = make_imbalanced(cwd / f"data-{seed}", seed, args.major, args.minor, args.val)
            for mode in MODES:
                results[mode].append(train(data, mode, seed, args, cwd))
                print(f"seed {seed} {mode}: {results[mode][-1]['val_balanced_acc']:.3f}",
                      file=sys.stderr)  # fmt: skip
    print(f"machine: {machine()}; {args.major}:{args.minor} ({args.major // args.minor}:1), "
          f"{args.epochs} epochs at {args.size} px, seeds {args.seeds}")  # fmt: skip
    print("\n| --balance | balanced acc (mean, spread) | top-1 | macro-F1 |")
    print("|---|---|---|---|")
    for mode in MODES:
        scores = {
            k: [r[f"val_{k}"] for r in results[mode]] for k in ("balanced_acc", "top1", "macro_f1")
        }
        mean = {k: statistics.fmean(v) for k, v in scores.items()}
        spread = max(scores["balanced_acc"]) - min(scores["balanced_acc"])
        print(f"| {mode} | {mean['balanced_acc']:.3f} ({spread:.3f}) | {mean['top1']:.3f} | "
              f"{mean['macro_f1']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
