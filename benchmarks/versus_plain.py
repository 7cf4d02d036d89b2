"""Figures of gpu_check.sh's comparison with the plain loop, one line each, read by bash.

versus_plain.py plain PLAIN_LOG START  -> images/s, final top-1, seconds from START
                                          to the first epoch at that top-1
versus_plain.py ours METRICS PLAIN_IMAGES_PER_S TARGET
                                       -> images/s, its ratio to the plain loop's,
                                          seconds from the command to TARGET (or never)
"""

from __future__ import annotations

import json
import sys


def plain(log: str, start: float) -> str:
    lines = [json.loads(line) for line in open(log) if line.startswith("{")]
    final = lines[-1]
    target = final["val_top1"]
    epochs = [r for r in lines if "epoch" in r]
    reached = next((r["time"] - start for r in epochs if r["val_top1"] >= target - 1e-9), None)
    shown = f"{reached:.0f}" if reached is not None else "?"
    return f"{final['images_per_s']:.0f} {target:.4f} {shown}"


def ours(metrics: str, plain_rate: float, target: float) -> str:
    rows = [json.loads(line) for line in open(metrics)]
    rate = rows[-1]["train_images_per_s"]
    reached = next((r["since_start_s"] for r in rows if r["val_top1"] >= target - 1e-9), None)
    shown = f"{reached:.0f}" if reached is not None else "never"
    return f"{rate:.0f} {rate / max(plain_rate, 1.0):.2f} {shown}"


if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    if kind == "plain":
        print(plain(args[0], float(args[1])))
    else:
        print(ours(args[0], float(args[1]), float(args[2])))
