"""paratrain against the textbook DDP loop (benchmarks/plain_ddp.py), side by side.

Same generated image folder (JPEGs of 400x300 pixels, 5 classes, 80/20 train/val), same
model, image size, batch, epochs and learning rate; runs alternate. Three variants:

* plain    — benchmarks/plain_ddp.py (ImageFolder + PIL, DistributedSampler, DDP, fp32)
* matched  — paratrain with the plain loop's settings: fp32, no cache, contiguous
             memory, the same loader workers (framework overhead; target >= 0.98x)
* defaults — paratrain as it comes (decoded-image cache, channels_last, auto precision,
             loader workers from the cores; target >= 2x end to end), its cache built
             during the run
* warm     — the defaults again, the cache ready from the run before (a second run on
             the same images)

Layouts: 1x2 (one process, 2 threads) and 2x1 (two processes, 1 thread each).
Printed: training images/s (training time only), end-to-end images/s (every trained
image over the wall time of the whole command, start-up and cache build included),
validation top-1, and the ratios to the plain loop.

    python benchmarks/vs_plain_loop.py [--images 3000] [--sizes 64 128] \\
        [--layouts 1x2 2x1] [--epochs 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
CLASSES = 5


def make_folder(
    root: Path,
    count: int,
    part: int = 0,
    parts: int = 1,
    noise: float = 45.0,
    jitter: float = 0.3,
    shift: float = 0.0,
    contrast: float = 25.0,
    span: float = np.pi,
) -> Path:
    """Class = colour cast + stripe direction, under texture and noise; 80/20 split.
    ``part`` of ``parts``: every parts-th image from part on (for writing in parallel);
    ``noise`` (pixel noise's deviation) and ``jitter`` (of the stripes' angle, radians)
    set how far the classes overlap; ``shift`` (a per-image colour offset's deviation)
    hides the class's colour cast, ``contrast`` is the stripes' amplitude. The classes'
    stripe angles are spread over ``span``: over a half-turn (pi) a mirror image turns
    one class's stripes into another's (angle a becomes pi - a), over a quarter-turn
    (pi / 2) into no class's, so that a horizontal flip keeps the label."""
    tints = np.random.default_rng(0).uniform(110, 150, size=(CLASSES, 3))  # close colours
    yy, xx = np.mgrid[0:300, 0:400].astype(np.float32)
    for i in range(part, count, parts):
        rng = np.random.default_rng(i + 1)
        label = i % CLASSES
        subset = "val" if (i // CLASSES) % 5 == 0 else "train"
        folder = root / subset / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        angle = span * label / CLASSES + rng.normal(0, jitter)  # neighbours overlap
        stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) / rng.uniform(6, 14))
        cast = tints[label] + rng.normal(0, shift, size=3) if shift else tints[label]
        pixels = cast + contrast * stripes[..., None] + rng.normal(0, noise, size=(300, 400, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
            folder / f"{i:05d}.jpg", quality=90
        )
    return root


def run(
    command: list[str],
    threads: int,
    cwd: Path,
    timeout: float | None = None,
    tolerate: str | None = None,
    **extra: str,
) -> tuple[float, str]:
    """(wall seconds, stdout) of a command that must succeed, or whose error names
    ``tolerate`` (then no output). Past ``timeout`` its whole process group (a launcher
    and its workers) is killed and subprocess.TimeoutExpired raised."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PARATRAIN_NO_BAR": "1", **extra}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    wall = time.perf_counter() - start
    if process.returncode != 0 and not (tolerate and tolerate in err):
        sys.exit(f"failed: {' '.join(command)}\n{err[-3000:]}")
    return wall, out if process.returncode == 0 else ""


def plain_command(data: Path, size: int, nproc: int, epochs: int, *extra: str) -> list[str]:
    """benchmarks/plain_ddp.py on ``data``: batch 16 per process, one loader worker;
    under torch's launcher for more than one process."""
    script = [
        str(HERE / "plain_ddp.py"), str(data), "--image-size", str(size), "--batch-size",
        "16", "--epochs", str(epochs), "--workers", "1", *extra,
    ]  # fmt: skip
    if nproc == 1:
        return [sys.executable, *script]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc-per-node={nproc}", *script]


def plain(data, size, nproc, args, cwd):
    command = plain_command(data, size, nproc, args.epochs)
    wall, out = run(command, 2 // nproc, cwd)
    result = json.loads(out.strip().splitlines()[-1])
    return result["images_per_s"], wall, result["val_top1"]


def paratrain(data, size, nproc, args, cwd, matched: bool, name: str, cache: str = ""):
    command = [
        sys.executable,
        "-m",
        "paratrain",
        "train",
        "--data",
        str(data),
        "--image-size",
        str(size),
        "--batch-size",
        "16",
        "--epochs",
        str(args.epochs),
        "--nproc",
        str(nproc),
        "--lrf",
        "0",
        "--name",
        name,
    ]
    if matched:
        command += [
            "--precision",
            "32",
            "--cache",
            "off",
            "--memory-format",
            "contiguous",
            "--workers",
            "1",
        ]
    wall, _ = run(command, 2 // nproc, cwd, PARATRAIN_CACHE=cache or str(cwd / "cache" / name))
    rows = [json.loads(x) for x in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(1 / r["train_images_per_s"] for r in rows)  # per image, summed over epochs
    return len(rows) / seconds, wall, rows[-1]["val_top1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x1"])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        data = make_folder(cwd / "data", args.images)
        n_train = sum(1 for _ in (data / "train").rglob("*.jpg"))
        print(
            f"{args.images} JPEGs 400x300 ({n_train} train), resnet18, batch 16 per process, "
            f"{args.epochs} epochs, {args.rounds} round(s)"
        )
        for size in args.sizes:
            for layout in args.layouts:
                nproc = int(layout.split("x")[0])
                got = {"plain": [], "matched": [], "defaults": [], "warm": []}
                for r in range(args.rounds):
                    got["plain"].append(plain(data, size, nproc, args, cwd))
                    got["matched"].append(
                        paratrain(data, size, nproc, args, cwd, True, f"m{size}{layout}{r}")
                    )
                    cache = str(cwd / "cache" / f"d{size}{layout}{r}")  # new: built in the run
                    got["defaults"].append(
                        paratrain(data, size, nproc, args, cwd, False, f"d{size}{layout}{r}", cache)
                    )
                    got["warm"].append(  # the same again, its cache ready from the run before
                        paratrain(data, size, nproc, args, cwd, False, f"w{size}{layout}{r}", cache)
                    )
                best = {k: max(v, key=lambda t: t[0]) for k, v in got.items()}
                e2e = {k: args.epochs * n_train / min(t[1] for t in v) for k, v in got.items()}
                base_ips, base_e2e = best["plain"][0], e2e["plain"]
                print(f"\n{size} px, {layout}:")
                for k in got:
                    print(
                        f"  {k:9s} train {best[k][0]:7.1f} img/s ({best[k][0] / base_ips:5.2f}x)  "
                        f"end to end {e2e[k]:7.1f} img/s ({e2e[k] / base_e2e:5.2f}x)  "
                        f"val top-1 {best[k][2]:.1%}"
                    )


if __name__ == "__main__":
    main()
