"""What saving an fsdp run costs rank 0: sharded (each rank writes its own shards through
torch.distributed.checkpoint) against gathered (the whole model and optimizer gathered to
rank 0, then written as one file: paratrain's format before sharded checkpoints).

Each way runs in fresh processes: build the model under fsdp, train two steps (SGD with
momentum, fp32), hand freed memory back to the system (malloc_trim), reset rank 0's
resident-memory high-water mark (VmHWM, through /proc/self/clear_refs) and save. Printed: the whole state's bytes (parameters and
momentum, as a single-device checkpoint holds them), and rank 0's peak memory above its
memory before the save, for each way.

    python benchmarks/sharded_save.py [--model resnet152] [--nproc 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time
from pathlib import Path

import torch
from _spawn import run as spawn

from paratrain.config import TrainConfig
from paratrain.distributed import comm
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.recipe import build_optimizer
from paratrain.models.registry import build_model
from paratrain.parallel import sharded
from paratrain.parallel.checkpoint_io import save_atomic
from paratrain.parallel.parallelize import parallelize

CLASSES, SIZE, BATCH = 10, 32, 4


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _worker(rank, world, model, way, folder):
    cfg = TrainConfig(
        model=model, image_size=SIZE, batch_size=BATCH, precision="32", strategy="fsdp"
    )
    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    parts = parallelize(build_model(cfg, CLASSES), cfg, runtime)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    precision = Precision("32", runtime.device)
    x, y = torch.randn(BATCH, 3, SIZE, SIZE), torch.randint(0, CLASSES, (BATCH,))
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        parts.forward_backward(x, y, torch.nn.CrossEntropyLoss(), precision, 1)
        optimizer.step()
    whole = 2 * sum(p.numel() * 4 for p in build_model(cfg, CLASSES).parameters())
    comm.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what training freed goes back to the system,
    before = _status("VmRSS")  # so the save's own allocations raise the resident peak
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    if way == "sharded":
        sharded.save(Path(folder) / "last", parts, optimizer, {"epoch": 1})
    else:
        model_state = parts.state_dict()
        optimizer_state = parts.optimizer_state_dict(optimizer)
        if rank == 0:
            save_atomic(
                {"model": model_state, "optimizer": optimizer_state}, Path(folder) / "last.pt"
            )
        comm.barrier()
    seconds = time.perf_counter() - start
    return {"above": _status("VmHWM") - before, "whole": whole, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet152")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    rows = {}
    for way in ("gathered", "sharded"):
        with tempfile.TemporaryDirectory() as folder:
            rows[way] = spawn(_worker, args.nproc, threads, args.model, way, folder)[0]
    whole = rows["sharded"]["whole"]
    print(
        f"{args.model} under fsdp on {args.nproc} CPU processes; the whole state "
        f"(parameters + momentum, fp32): {whole / 2**20:.1f} MiB"
    )
    for way, row in rows.items():
        print(
            f"  {way:<9} rank 0's peak above its memory before the save: "
            f"{row['above'] / 2**20:8.1f} MiB ({row['above'] / whole:.2f}x the whole state), "
            f"{row['seconds']:.2f} s"
        )
    print(f"sharded / gathered: {rows['sharded']['above'] / rows['gathered']['above']:.3f}")


if __name__ == "__main__":
    main()
