"""--balance on a generated set at 10:1: balanced accuracy with and without balancing.

The set: 5 classes of shapes on clutter (benchmarks/ablation.py's shapes, 96x72 px),
class 0 ten times the others in training (``--major`` and ``--minor`` images), the
validation split balanced (``--val`` per class), so that balanced accuracy and macro-F1
say how well the rare classes are learnt. Each mode (none, sampler, loss) trains the
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
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from vs_plain_loop import run  # noqa: E402

CLASSES = 5
MODES = ("none", "sampler", "loss")


def _shape(rng: np.random.Generator, label: int) -> Image.Image:
    background = rng.integers(0, 256, size=(9, 12, 3), dtype=np.uint8)
    image = Image.fromarray(background).resize((96, 72), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(image)
    for _ in range(4):  # clutter: lines that are no shape
        points = [tuple(int(v) for v in rng.integers(0, 96, 2)) for _ in range(2)]
        draw.line(points, fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=2)
    r = int(rng.uniform(10, 26))
    cx, cy = int(rng.uniform(r, 96 - r)), int(rng.uniform(r, 72 - r))
    colour = tuple(int(v) for v in rng.integers(0, 256, 3))
    box = (cx - r, cy - r, cx + r, cy + r)
    if label == 0:
        draw.ellipse(box, fill=colour)
    elif label == 1:
        draw.rectangle(box, fill=colour)
    elif label == 2:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    elif label == 3:
        draw.rectangle((cx - r, cy - r // 4, cx + r, cy + r // 4), fill=colour)
        draw.rectangle((cx - r // 4, cy - r, cx + r // 4, cy + r), fill=colour)
    else:
        draw.ellipse(box, outline=colour, width=max(3, r // 4))
    return image


def make_imbalanced(root: Path, seed: int, major: int, minor: int, val: int) -> Path:
    """``root/{train,val}/class_<k>/*.jpg``: class 0 ``major`` training images, the
    others ``minor``; ``val`` of every class in validation."""
    rng = np.random.default_rng(seed)
    for label in range(CLASSES):
        for subset, count in (("train", major if label == 0 else minor), ("val", val)):
            folder = root / subset / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                _shape(rng, label).save(folder / f"{i:04d}.jpg", quality=90)
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
