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
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _spawn import run as spawn

from paratrain.config import TrainConfig
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.precision import Precision
from paratrain.engine.recipe import build_optimizer
from paratrain.models.registry import build_model

try:  # this tree, or an older one (parallelize lived in parallel/__init__)
    from paratrain.parallel.parallelize import parallelize
except ImportError:
    from paratrain.parallel import parallelize  # type: ignore[attr-defined,no-redef]

CLASSES = 10


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


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
    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    parts = parallelize(build_model(cfg, CLASSES), cfg, runtime)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    precision, criterion = Precision("32", runtime.device), torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(rank // args.stages)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    y = torch.randint(0, CLASSES, (args.batch_size,), generator=generator)
    parts.train()
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        parts.forward_backward(x, y, criterion, precision, 1)
        parts.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # the step ends when every stage of every copy is done
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), _status("VmHWM") - before


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
