"""Peak memory per process, FSDP vs DDP, side by side: ResNet-50 on 2 CPU processes.

Each strategy runs in processes of its own, built as a run builds it (fsdp: rank 0 on
the CPU, the others on the meta device, filled by broadcast). Every process measures
its resident-memory high-water mark (VmHWM, reset through /proc/self/clear_refs just
before the model is built) over building, wrapping and three training steps (SGD with
momentum, --precision 32 or bf16-mixed); on CUDA the allocator's peak
(torch.cuda.max_memory_allocated). Printed per strategy: each rank's peak above its
memory before the model, the largest absolute peak, and the bytes each process holds
in parameters, gradients and optimizer state (its shards under FSDP); then the ratios.

    python benchmarks/fsdp_memory.py [--model resnet50] [--image-size 64] [--batch-size 8]
        [--precision 32|bf16-mixed]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from _spawn import run as spawn
from _spawn import status_bytes

from paratrain.config import TrainConfig
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.recipe import build_optimizer
from paratrain.parallel.parallelize import build_parts

CLASSES = 10


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
    return local.numel() * local.element_size()


def _worker(rank, world, args, strategy):
    cfg = TrainConfig(
        model=args.model,
        image_size=args.image_size,
        batch_size=args.batch_size,
        precision=args.precision,
        strategy=strategy,
    )
    cuda = torch.cuda.is_available()
    runtime = Runtime(
        env=detect(os.environ),
        device=torch.device("cuda", rank) if cuda else torch.device("cpu"),
        backend="nccl" if cuda else "gloo",
    )
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=runtime.device)
    y = torch.randint(0, CLASSES, (args.batch_size,), device=runtime.device)
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    if cuda:
        torch.cuda.reset_peak_memory_stats(runtime.device)
    parts = build_parts(cfg, CLASSES, runtime)
    built = torch.cuda.max_memory_allocated(runtime.device) if cuda else status_bytes("VmHWM")
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    precision = Precision(args.precision, runtime.device)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        parts.forward_backward(x, y, torch.nn.CrossEntropyLoss(), precision, 1)
        parts.after_backward()
        optimizer.step()
    peak = torch.cuda.max_memory_allocated(runtime.device) if cuda else status_bytes("VmHWM")
    params = list(parts.parameters())
    held = sum(_local_bytes(p) for p in params)
    held += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    held += sum(
        _local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    start = 0 if cuda else before
    return {"peak": peak, "above": peak - start, "built": built - start, "held": held, "cuda": cuda}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--precision", default="32", choices=("32", "bf16-mixed"))
    args = parser.parse_args()
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    results = {s: spawn(_worker, args.nproc, threads, args, s) for s in ("ddp", "fsdp")}
    where = "CUDA allocator peak" if results["ddp"][0]["cuda"] else "resident high-water mark"
    print(
        f"{args.model}, {args.nproc} processes, batch {args.batch_size} x {args.image_size}px, "
        f"SGD momentum, precision {args.precision}; MiB ({where})"
    )
    ranks = "".join(f"{f'rank {r} built':>14}{'trained':>9}" for r in range(args.nproc))
    print(f"{'':<6}{ranks}{'largest peak':>14}{'state held':>12}   (above the start)")
    worst = {}
    for strategy, per_rank in results.items():
        worst[strategy] = {k: max(r[k] for r in per_rank) for k in ("peak", "above", "held")}
        w = worst[strategy]
        each = "".join(f"{r['built'] / 2**20:14.1f}{r['above'] / 2**20:9.1f}" for r in per_rank)
        print(f"{strategy:<6}{each}{w['peak'] / 2**20:14.1f}{w['held'] / 2**20:12.1f}")
    ratio = worst["fsdp"]["above"] / worst["ddp"]["above"]
    print(
        f"fsdp / ddp, peak memory above the start: {ratio:.3f}; "
        f"held state: {worst['fsdp']['held'] / worst['ddp']['held']:.3f}"
    )


if __name__ == "__main__":
    main()
