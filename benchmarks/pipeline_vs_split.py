"""Pipeline vs naive split vs one process: training throughput on CPU processes.

A device here is a share of the CPU's cores: the pipeline runs P processes of
cores/P threads each; the naive split runs the same P stages one after another in one
process with cores/P threads (one device computing at a time, as on P GPUs); one
process with every core is shown for reference. The ideal pipeline keeps each device
busy M/(M+P-1) of the time, against 1/P for the split, so its ideal speedup over the
split is P·M/(M+P-1). Target: the measured speedup at least 0.85 of that.

    python benchmarks/pipeline_vs_split.py [--model resnet18] [--image-size 128]
        [--batch-size 64] [--microbatches 4 8] [--stages 2] [--rounds 2] [--steps 6]

On a CPU, small micro-batches compute less efficiently than the whole batch (ResNet-18
at 64 px: 8 images take 1.3x the time per image of 32), which the bound does not count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _spawn import run as spawn

from paratrain.config import TrainConfig
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.recipe import build_optimizer
from paratrain.models.registry import build_model

try:  # this tree, or an older one (parallelize lived in parallel/__init__)
    from paratrain.parallel.parallelize import parallelize
except ImportError:
    from paratrain.parallel import parallelize  # type: ignore[attr-defined,no-redef]

CLASSES = 10


def _config(args, **overrides) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        image_size=args.image_size,
        batch_size=args.batch_size,
        precision="32",
        memory_format="contiguous",
        **overrides,
    )


def _seconds_per_step(cfg: TrainConfig, steps: int, warmup: int) -> float:
    """Median over ``steps`` timed steps (rank 0's clock, every rank synchronised)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    runtime = Runtime(
        env=detect(os.environ), device=torch.device("cpu"), backend="gloo" if world > 1 else None
    )
    parts = parallelize(build_model(cfg, CLASSES), cfg, runtime)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    precision, criterion = Precision("32", runtime.device), torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(dist.get_rank() // cfg.stages if world > 1 else 0)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=generator)
    y = torch.randint(0, CLASSES, (cfg.batch_size,), generator=generator)
    parts.train()
    times = []
    for step in range(warmup + steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        parts.forward_backward(x, y, criterion, precision, 1)
        parts.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()  # the step ends when its last stage is done
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pipeline_worker(rank, world, args, microbatches, schedule):
    cfg = _config(
        args, strategy="pipeline", stages=args.stages, microbatches=microbatches, schedule=schedule
    )
    return _seconds_per_step(cfg, args.steps, args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    per_device = max(1, cores // args.stages)
    devices = ",".join(["cpu"] * args.stages)
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # alternate, so drift in machine load hits all alike
        torch.set_num_threads(cores)
        samples.setdefault("one process", []).append(
            _seconds_per_step(_config(args), args.steps, args.warmup)
        )
        torch.set_num_threads(per_device)
        samples.setdefault("split", []).append(
            _seconds_per_step(
                _config(args, strategy="split", devices=devices), args.steps, args.warmup
            )
        )
        for m in args.microbatches:
            for schedule in args.schedules:
                seconds = spawn(_pipeline_worker, args.stages, per_device, args, m, schedule)[0]
                samples.setdefault(f"pipeline {schedule} M={m}", []).append(seconds)
    step = {name: statistics.median(values) for name, values in samples.items()}
    p = args.stages
    print(
        f"{args.model} at {args.image_size}px, batch {args.batch_size}, {p} stages, "
        f"{cores} cores: a device = {per_device} thread(s); median of {args.rounds} rounds "
        f"x {args.steps} steps"
    )
    print(f"{'':<22} {'images/s':>9} {'vs split':>9} {'ideal':>7} {'of ideal':>9}")
    split = step["split"]
    verdicts = []
    for name, seconds in step.items():
        rate = args.batch_size / seconds
        line = f"{name:<22} {rate:9.1f} {split / seconds:8.2f}x"
        if name.startswith("pipeline"):
            m = int(name.split("M=")[1])
            ideal = p * m / (m + p - 1)
            share = (split / seconds) / ideal
            verdicts.append(share >= 0.85)
            line += f" {ideal:6.2f}x {share:8.0%}"
        print(line)
    print(
        f"target: every pipeline at least 85% of its ideal speedup over the split: "
        f"{'met' if all(verdicts) else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
