"""How long a step checkpoint stalls training: written in place (the default) or in the
background (--async-save: a copy of the state in host memory, then one writer thread).

For each model: the stall of one save each way (median of --saves), the background
write's own time, and the wall time of --steps SGD steps (batch 16 at 64 px, 2 threads)
with a save every --every steps each way and with none. Whole-file checkpoints, as DDP,
DP and one process write them (the model and SGD's momentum), to a folder on this disk.
``--sharded``: fsdp on 2 gloo processes instead, each writing its shards through
torch.distributed.checkpoint (``dcp.save`` in place, ``dcp.async_save`` in the
background); the stall is rank 0's, the write's time is until every rank finished.

    python benchmarks/async_save.py --models resnet18 resnet50 resnet101 [--sharded]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision

from paratrain.parallel.checkpoint_io import WholeIO
from paratrain.parallel.parts import ModelParts

sys.path.insert(0, str(Path(__file__).parent))
from _machine import machine  # noqa: E402


def _setup(name: str):
    model = torchvision.models.get_model(name, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()  # momentum buffers exist, as in a run
    return ModelParts([model]), optimizer, step


def _stalls(parts, optimizer, folder: Path, saves: int) -> dict[str, float]:
    io, sync, stall, write = WholeIO(), [], [], []
    for i in range(saves):
        start = time.perf_counter()
        io.save(folder / "last.pt", parts, optimizer, {"step": i})
        sync.append(time.perf_counter() - start)
        start = time.perf_counter()
        io.save(folder / "last.pt", parts, optimizer, {"step": i}, background=True)
        stall.append(time.perf_counter() - start)
        io.wait()
        write.append(time.perf_counter() - start)
    return {
        k: statistics.median(v) for k, v in (("sync", sync), ("stall", stall), ("write", write))
    }


def _run(parts, optimizer, step, folder: Path, steps: int, every: int, how: str) -> float:
    io = WholeIO()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if how != "none" and i % every == 0:
            io.save(folder / "last.pt", parts, optimizer, {"step": i}, background=how == "async")
    io.wait()
    return time.perf_counter() - start


def _sharded_worker(rank: int, world: int, name: str, saves: int, folder: str) -> dict:
    import os

    from paratrain.config import TrainConfig
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime
    from paratrain.engine.run.precision import Precision
    from paratrain.engine.run.recipe import build_optimizer
    from paratrain.models.registry import build_model
    from paratrain.parallel import sharded
    from paratrain.parallel.parallelize import parallelize

    cfg = TrainConfig(model=name, image_size=64, batch_size=16, precision="32", strategy="fsdp")
    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    parts = parallelize(build_model(cfg, 10), cfg, runtime)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    optimizer.zero_grad(set_to_none=True)
    parts.forward_backward(x, y, torch.nn.CrossEntropyLoss(), Precision("32", runtime.device), 1)
    optimizer.step()
    rest, target = {"config": {}, "classes": []}, Path(folder) / "last"
    sync, stall, write = [], [], []
    for _ in range(saves):
        start = time.perf_counter()
        sharded.save(target, parts, optimizer, rest)
        sync.append(time.perf_counter() - start)
        start = time.perf_counter()
        pending = sharded.save_async(target, parts, optimizer, rest)
        stall.append(time.perf_counter() - start)
        pending.finish()
        write.append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in target.iterdir())
    return {"MB": size / 2**20, "sync": statistics.median(sync),
            "stall": statistics.median(stall), "write": statistics.median(write)}  # fmt: skip


def _sharded(models: list[str], saves: int) -> None:
    from _spawn import run as spawn

    print(f"fsdp on 2 processes (1 thread each) | {'MB':>6} | {'save ms':>8} "
          f"{'stall ms':>9} {'write ms':>9}")  # fmt: skip
    for name in models:
        with tempfile.TemporaryDirectory(dir=".") as tmp:
            t = spawn(_sharded_worker, 2, 1, name, saves, tmp)[0]
        print(f"{name:>35} | {t['MB']:>6.0f} | {t['sync'] * 1e3:>8.0f} "
              f"{t['stall'] * 1e3:>9.1f} {t['write'] * 1e3:>9.0f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "resnet101"])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--sharded", action="store_true", help="fsdp's sharded checkpoints")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(machine())
    if args.sharded:
        _sharded(args.models, args.saves)
        return
    print(f"{'model':>10} {'MB':>6} | {'save ms':>8} {'stall ms':>9} {'write ms':>9} | "
          f"{args.steps} steps, a save every {args.every}: {'none s':>7} {'sync s':>7} {'async s':>8}")  # fmt: skip
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for name in args.models:
            parts, optimizer, step = _setup(name)
            size = sum(t.numel() * t.element_size() for t in parts.state_dict().values()) * 2
            t = _stalls(parts, optimizer, Path(tmp), args.saves)
            walls = {how: _run(parts, optimizer, step, Path(tmp), args.steps, args.every, how)
                     for how in ("none", "sync", "async")}  # fmt: skip
            print(
                f"{name:>10} {size / 2**20:>6.0f} | {t['sync'] * 1e3:>8.0f} {t['stall'] * 1e3:>9.1f} "
                f"{t['write'] * 1e3:>9.0f} | {'':>{len(str(args.steps)) + 30}}{walls['none']:>7.2f} "
                f"{walls['sync']:>7.2f} {walls['async']:>8.2f}"
            )


if __name__ == "__main__":
    main()
