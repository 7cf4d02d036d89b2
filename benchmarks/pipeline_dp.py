"""Pipeline x data parallel: step time of P stages x R replicas on CPU processes.

Each of the P x R processes holds one stage of one copy; each stage's R copies reduce
their gradients (paratrain shards each stage over its copies with FSDP2, unit by unit,
so a unit's gradients are reduced while the rest of backward runs). Printed: the median
step over the timed steps, and images/s. Run it against two source trees to compare
them side by side (alternate the runs):

    PYTHONPATH=src python benchmarks/pipeline_dp.py [--model resnet18] [--image-size 64]
        [--batch-size 16] [--microbatches 4] [--stages 2] [--replicas 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from _spawn import run as spawn
from _spawn import status_bytes
from pipeline_vs_split import _seconds_per_step as seconds_per_step

from paratrain.config import TrainConfig


def _worker(rank: int, world: int, args) -> tuple[float, int]:
    cfg = TrainConfig(
        model=args.model,
        image_size=args.image_size,
        batch_size=args.batch_size,
        precision="32",
        memory_format="contiguous",
        strategy="pipeline",
        stages=args.stages,
        microbatches=args.microbatches,
    )
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    seconds = seconds_per_step(cfg, args.steps, args.warmup)
    return seconds, status_bytes("VmHWM") - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    world = args.stages * args.replicas
    threads = max(1, len(os.sched_getaffinity(0)) // world)
    results = spawn(_worker, world, threads, args)
    seconds, peak = results[0][0], max(memory for _, memory in results)
    print(
        f"{args.model} at {args.image_size}px, batch {args.batch_size} per copy, "
        f"{args.stages} stages x {args.replicas} copies, {args.microbatches} micro-batches, "
        f"{threads} thread(s) a process: step {seconds * 1000:.1f} ms, "
        f"{args.batch_size * args.replicas / seconds:.1f} images/s, largest process's peak "
        f"memory above its start {peak / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
