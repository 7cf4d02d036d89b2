"""Cost of paratrain's SyncBatchNorm on CPU: ResNet-18 forward+backward on 2 processes.

DDP + SyncBatchNorm vs DDP + plain BatchNorm, measured side by side in one run
(alternating rounds, median step time). Target: ratio at most 1.25.

    python benchmarks/sync_bn_cost.py [--image-size 112] [--batch-size 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _spawn import run as spawn
from torch import nn

from paratrain.parallel.sync_batchnorm import SyncBatchNorm


def _time_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, world: int, args) -> dict[str, list[float]]:
    import torchvision

    torch.manual_seed(0)
    base = torchvision.models.resnet18(num_classes=10)
    models = {
        "batchnorm": nn.parallel.DistributedDataParallel(base),
        "syncbn": nn.parallel.DistributedDataParallel(
            SyncBatchNorm.convert(torchvision.models.resnet18(num_classes=10))
        ),
    }
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch_size,))
    for model in models.values():
        _time_steps(model, x, y, 2)  # warm-up
    samples = {name: [] for name in models}
    for _ in range(args.rounds):  # alternate, so drift in machine load hits both alike
        for name, model in models.items():
            samples[name] += _time_steps(model, x, y, args.steps)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 2) // args.nproc)
    samples = spawn(_worker, args.nproc, threads, args)[0]
    plain = statistics.median(samples["batchnorm"])
    synced = statistics.median(samples["syncbn"])
    print(
        f"ResNet-18, {args.nproc} CPU processes, batch {args.batch_size} x "
        f"{args.image_size}px, forward+backward, median of {len(samples['syncbn'])} steps"
    )
    print(f"  DDP + BatchNorm      {plain * 1e3:8.1f} ms")
    print(f"  DDP + SyncBatchNorm  {synced * 1e3:8.1f} ms")
    print(f"  ratio {synced / plain:.3f} (target <= 1.25)")


if __name__ == "__main__":
    main()
