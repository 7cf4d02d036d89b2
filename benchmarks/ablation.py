"""Which recipe settings earn a place in the defaults: each measured on and off, on two
generated data sets, side by side.

Data sets (5 classes, JPEGs of 400x300, 80/20 train/val):

* stripes — benchmarks/vs_plain_loop.py's photo set made hard, its labels kept by a
  mirror image (time_to_accuracy.MIRROR_SAFE): a stripe direction and a colour cast per
  class, hidden under per-image colour offsets and heavy noise (neighbouring classes
  overlap)
* shapes  — a filled circle, square, triangle, cross or ring per class, of random size,
  place and colour, on a cluttered background

Every run: ``paratrain train`` with its defaults and the same epochs, image size and
processes, plus one setting; printed as a markdown table of final validation top-1 (and
the EMA's where on) and wall seconds, per data set, and the difference to the defaults.

    python benchmarks/ablation.py [--images 1500] [--size 64] [--epochs 6] [--nproc 2] \\
        [--seeds 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from time_to_accuracy import LOW_RES, MIRROR_SAFE  # noqa: E402
from vs_plain_loop import make_folder as make_stripes  # noqa: E402
from vs_plain_loop import run  # noqa: E402

CLASSES = 5


def make_shapes(root: Path, count: int) -> Path:
    """One shape per class at a random size, place and colour, on clutter."""
    for i in range(count):
        rng = np.random.default_rng(10_000 + i)
        label = i % CLASSES
        subset = "val" if (i // CLASSES) % 5 == 0 else "train"
        folder = root / subset / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        background = rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)
        image = Image.fromarray(background).resize((400, 300), Image.Resampling.BILINEAR)
        draw = ImageDraw.Draw(image)
        for _ in range(6):  # clutter: lines that are no shape
            points = [tuple(int(v) for v in rng.integers(0, 400, 2)) for _ in range(2)]
            draw.line(points, fill=tuple(int(v) for v in rng.integers(0, 256, 3)), width=3)
        r = int(rng.uniform(40, 110))
        cx, cy = int(rng.uniform(r, 400 - r)), int(rng.uniform(r, 300 - r))
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
            draw.ellipse(box, outline=colour, width=max(4, r // 4))
        image.save(folder / f"{i:05d}.jpg", quality=90)
    return root


def make_set(name: str, root: Path, count: int) -> Path:
    """One of the two generated sets by name: ``stripes`` (mirror-safe) or ``shapes``."""
    if name == "stripes":
        return make_stripes(root, count, **MIRROR_SAFE)
    return make_shapes(root, count)


def settings(size: int) -> dict[str, list[str]]:
    small = max(8, (size // 2) // 8 * 8)
    return {
        "defaults": [],
        "label smoothing 0.1": ["--label-smoothing", "0.1"],
        "no decay on norms and biases": ["--norm-weight-decay", "0", "--bias-weight-decay", "0"],
        "EMA 0.99": ["--ema-decay", "0.99"],
        "warm-up 1 epoch": ["--warmup-epochs", "1"],
        "cosine to 0": ["--lrf", "0"],
        f"progressive {small}:{size}": ["--progressive", f"{small}:{size}"],
        "flip TTA": ["--tta", "flip"],
        f"val size {size * 5 // 4}": ["--val-size", str(size * 5 // 4)],
        " ".join(LOW_RES): LOW_RES,
    }


def train(data: Path, args, cwd: Path, name: str, extra: list[str], seed: int) -> dict:
    command = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data),
        "--image-size", str(args.size), "--epochs", str(args.epochs), "--nproc",
        str(args.nproc), "--seed", str(seed), "--name", name, *extra,
    ]  # fmt: skip
    threads = max(1, 2 // args.nproc)
    wall, _ = run(command, threads, cwd, PARATRAIN_CACHE=str(cwd / "cache"))
    rows = [json.loads(x) for x in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {"top1": rows[-1]["val_top1"], "ema": rows[-1].get("val_top1_ema"), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1500)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    print(
        f"{args.images} JPEGs 400x300 per set, resnet18 at {args.size} px, {args.epochs} "
        f"epochs, {args.nproc} process(es), seeds {args.seeds}, {machine()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        sets = {name: make_set(name, cwd / name, args.images) for name in ("stripes", "shapes")}
        table: dict[str, dict[str, list[dict]]] = {}
        for label, extra in settings(args.size).items():
            for set_name, data in sets.items():
                for seed in args.seeds:
                    name = f"{set_name}-{len(table)}-{seed}"
                    got = train(data, args, cwd, name, extra, seed)
                    table.setdefault(label, {}).setdefault(set_name, []).append(got)
                    print(f"  {label} on {set_name}, seed {seed}: {got}", flush=True)
    base = {s: np.mean([r["top1"] for r in table["defaults"][s]]) for s in sets}
    print("\n| setting | " + " | ".join(f"{s} top-1 (vs defaults)" for s in sets) + " | wall s |")
    print("| --- | " + " | ".join("---" for _ in sets) + " | --- |")
    for label, by_set in table.items():
        cells = []
        for s in sets:
            top1 = np.mean([r["top1"] for r in by_set[s]])
            ema = [r["ema"] for r in by_set[s] if r["ema"] is not None]
            extra = f", EMA {np.mean(ema):.1%}" if ema else ""
            cells.append(f"{top1:.1%} ({(top1 - base[s]) * 100:+.1f}){extra}")
        wall = np.mean([r["wall"] for s in sets for r in by_set[s]])
        print(f"| {label} | " + " | ".join(cells) + f" | {wall:.0f} |")


if __name__ == "__main__":
    main()
