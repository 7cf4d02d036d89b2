"""What the low-res recipe saves a step, stage by stage: ResNet-18's training step (forward
and backward) timed one stage at a time, at a size and at the low-res recipe's 5/8 of it
(engine/prerun/budget.py: TRAIN_SHARE, rounded to 8 px; twice the batch).

A ResNet halves the side five times. At 64 px its stages see 16, 8, 4 and 2 pixels a side;
at 40 px, 10, 5, 3 and 2: the last stage is as large at both sizes, and it costs as much
a pixel as each of the others. So on small images the recipe saves much less than its
pixels promise; at ImageNet's sizes (224 against 144) every stage shrinks. Printed per
stage: its output's side at each size, milliseconds an image at each, and the ratio;
then the whole step's ratio against the pixels'.

    python benchmarks/low_res_stages.py [--sizes 64 128 224] [--batch 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402

from paratrain.engine.prerun.budget import BATCH_FACTOR, TRAIN_SHARE, eighth  # noqa: E402


def stages(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """ResNet's stem, its four stages and its head, in order."""
    stem = torch.nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    head = torch.nn.Sequential(model.avgpool, torch.nn.Flatten(), model.fc)
    return [("stem", stem)] + [
        (f"layer{i}", getattr(model, f"layer{i}")) for i in range(1, 5)
    ] + [("head", head)]  # fmt: skip


def timed(stage: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    """The median seconds of a forward and backward through ``stage`` alone."""
    x = x.detach().requires_grad_(True)
    times = []
    for _ in range(repeats + 1):  # the first allocates
        start = time.perf_counter()
        out = stage(x)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def per_stage(size: int, batch: int, repeats: int) -> list[tuple[str, int, float]]:
    """(stage, its output's side, ms an image) at ``size`` and ``batch``."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(batch, 3, size, size)
    rows = []
    for name, stage in stages(model):
        seconds = timed(stage, x, repeats)
        with torch.no_grad():
            x = stage(x)
        side = x.shape[-1] if x.dim() == 4 else 1
        rows.append((name, side, 1000 * seconds / batch))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 224])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {machine()}, {args.threads} thread(s), ResNet-18, fp32, torch {torch.__version__}")
    for size in args.sizes:
        low = eighth(size * TRAIN_SHARE)
        given = per_stage(size, args.batch, args.repeats)
        lowered = per_stage(low, BATCH_FACTOR * args.batch, args.repeats)
        print(f"\n{size} px, batch {args.batch}  against  {low} px, batch "
              f"{BATCH_FACTOR * args.batch} (the low-res recipe)")  # fmt: skip
        print(f"{'stage':8} {'side':>9} {'ms an image':>16} {'saved':>6}")
        for (name, side, ms), (_, low_side, low_ms) in zip(given, lowered, strict=True):
            print(
                f"{name:8} {side:>4}/{low_side:<4} {ms:>7.2f}/{low_ms:<7.2f} {ms / low_ms:>5.2f}x"
            )
        whole, whole_low = sum(r[2] for r in given), sum(r[2] for r in lowered)
        print(f"{'step':8} {'':9} {whole:>7.2f}/{whole_low:<7.2f} {whole / whole_low:>5.2f}x   "
              f"(the pixels: {(size / low) ** 2:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
