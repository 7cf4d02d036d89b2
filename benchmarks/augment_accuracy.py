"""Does the batched device augmentation train as the loader's per-image one does?

The same short runs, augmented in the loader processes (``--augment-on cpu``) and on the
device in one batch (``--augment-on device``: roi_align's area filter in place of the
antialiased resize), over several seeds: the best validation top-1 of each, and the two
means against the seeds' spread. On a harder stripes set than vs_plain_loop.py's (2,000
400x300 JPEGs, 5 classes, more noise and angle jitter, a colour offset per image that
hides the class's cast), ResNet-18 at 64 px, from the decoded cache, one process:

    python benchmarks/augment_accuracy.py --seeds 0 1 2 3 4 --epochs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from paratrain import TrainConfig, train

sys.path.insert(0, str(Path(__file__).parent))
from _machine import machine  # noqa: E402
from vs_plain_loop import make_folder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        data = make_folder(Path(tmp) / "data", args.images, noise=70, jitter=0.6, shift=25)
        best: dict[str, list[float]] = {"cpu": [], "device": []}
        for seed in args.seeds:
            for where in best:
                summary = train(
                    TrainConfig(
                        data=str(data),
                        model="resnet18",
                        image_size=args.image_size,
                        epochs=args.epochs,
                        batch_size=32,
                        workers=1,
                        seed=seed,
                        augment_on=where,
                        cache="on",
                        cache_dir=str(Path(tmp) / "cache"),
                        output_dir=str(Path(tmp) / "runs"),
                        name=f"{where}-{seed}",
                    )  # fmt: skip
                )
                best[where].append(summary["best_val_top1"])
                print(f"seed {seed} augment on {where:6}: best top-1 {best[where][-1]:.2%}")
        for where, values in best.items():
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"{where:6}: mean {statistics.mean(values):.2%} +- {spread:.2%} (seeds' sd)")
        gap = statistics.mean(best["device"]) - statistics.mean(best["cpu"])
        print(f"device - cpu: {gap:+.2%}")


if __name__ == "__main__":
    main()
