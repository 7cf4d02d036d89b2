"""Memory per process, FSDP vs DDP: ResNet-50 on 2 CPU processes.

After two training steps (SGD with momentum, fp32), every process counts the bytes it
holds in parameters, gradients and optimizer state: its local shards under FSDP, the
whole tensors under DDP. (Peak resident memory is no fair measure of these between two
strategies: the allocator keeps and reuses what the first step freed.) Target: FSDP's parameters,
gradients and optimizer state at most 0.6x DDP's.

    python benchmarks/fsdp_memory.py [--model resnet50] [--image-size 64] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import os

import torch
from _spawn import run as spawn

from paratrain.config import TrainConfig
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.precision import Precision
from paratrain.engine.recipe import build_optimizer
from paratrain.models.registry import build_model
from paratrain.parallel import parallelize

CLASSES = 10


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
    return local.numel() * local.element_size()


def _worker(rank, world, args, strategy):
    cfg = TrainConfig(
        model=args.model,
        image_size=args.image_size,
        batch_size=args.batch_size,
        precision="32",
        strategy=strategy,
    )
    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, CLASSES, (args.batch_size,))
    held = {}
    parts = parallelize(build_model(cfg, CLASSES), cfg, runtime)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    precision = Precision("32", runtime.device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        parts.forward_backward(x, y, torch.nn.CrossEntropyLoss(), precision, 1)
        parts.after_backward()
        optimizer.step()

    step()  # the optimizer state exists from here on
    step()
    params = list(parts.parameters())
    held["parameters"] = sum(_local_bytes(p) for p in params)
    held["gradients"] = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    held["optimizer"] = sum(
        _local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    results = {s: spawn(_worker, args.nproc, threads, args, s) for s in ("ddp", "fsdp")}
    print(
        f"{args.model}, {args.nproc} processes, batch {args.batch_size} x {args.image_size}px, "
        "SGD momentum, fp32; per process (the largest over processes), MiB"
    )
    keys = ("parameters", "gradients", "optimizer")
    print(f"{'':<6}" + "".join(f"{k:>12}" for k in (*keys, "sum")))
    sums = {}
    for strategy, per_rank in results.items():
        worst = {k: max(r[k] for r in per_rank) for k in keys}
        sums[strategy] = sum(worst.values())
        cells = [worst[k] for k in keys] + [sums[strategy]]
        print(f"{strategy:<6}" + "".join(f"{c / 2**20:12.1f}" for c in cells))
    ratio = sums["fsdp"] / sums["ddp"]
    print(
        f"fsdp / ddp, parameters + gradients + optimizer state: {ratio:.3f} "
        f"(target <= 0.6: {'met' if ratio <= 0.6 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
