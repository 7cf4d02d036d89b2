"""`paratrain bench`: training-step speed on synthetic data already on the device.

Each timed step is split into data (taking the next batch from a pool on the device),
forward, backward and optimizer. With DDP the backward pass also carries the gradient
all-reduce, overlapped with it; communication is measured as the median synced step
minus the median step of the same work under ``no_sync`` (gradients kept local).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.engine import precision as precision_module
from paratrain.engine.precision import Precision
from paratrain.engine.recipe import build_optimizer
from paratrain.models.registry import build_model, logits_of
from paratrain.parallel import ModelParts, parallelize

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass
class BenchResult:
    model: str
    image_size: int
    batch_size: int
    world_size: int
    precision: str
    device: str
    steps: int
    step_ms: float  # median synced step, slowest rank
    no_sync_step_ms: float
    communication_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    images_per_s_per_process: float
    images_per_s: float
    peak_memory_mb: float  # CUDA: allocated tensors; CPU: resident set of the process


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@dataclass
class _Setup:
    parts: ModelParts
    optimizer: torch.optim.Optimizer
    precision: Precision
    pool: list[tuple[torch.Tensor, torch.Tensor]]
    criterion: nn.Module
    device: torch.device


def _prepare(cfg: TrainConfig, runtime: Runtime, classes: int = 10) -> _Setup:
    # steps under no_sync split out the communication: for DDP that is what gradient
    # accumulation does (no static graph, see parallel/ddp.py)
    parts = parallelize(build_model(cfg, classes), replace(cfg, grad_accum=2), runtime)
    pool = [
        (
            torch.randn(
                cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=runtime.device
            ).to(memory_format=parts.memory_format),
            torch.randint(0, classes, (cfg.batch_size,), device=runtime.device),
        )
        for _ in range(2)
    ]
    parts.train()
    precision = precision_module.build(cfg, runtime)
    precision.prepare(parts)
    return _Setup(
        parts,
        build_optimizer(parts, cfg, runtime.world_size),
        precision,
        pool,
        nn.CrossEntropyLoss(),
        runtime.device,
    )


def _timed_step(setup: _Setup, index: int, synced: bool = True) -> tuple[dict[str, float], float]:
    """One training step; seconds per phase, and the clock when backward started."""
    times = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        _sync(setup.device)
        now = time.perf_counter()
        times[name] = now - mark
        mark = now

    images, labels = setup.pool[index % len(setup.pool)]
    lap("data")
    with setup.precision.autocast():
        loss = setup.criterion(logits_of(setup.parts(images)), labels)
    lap("forward")
    backward_start = mark
    with setup.parts.no_sync() if not synced else contextlib.nullcontext():
        setup.precision.backward(loss)
    lap("backward")
    setup.precision.step(setup.optimizer)
    setup.optimizer.zero_grad(set_to_none=True)
    lap("optimizer")
    return times, backward_start


def run_bench(cfg: TrainConfig, runtime: Runtime, steps: int, warmup: int) -> BenchResult | None:
    """Time ``steps`` training steps after ``warmup``; every rank takes part, rank 0 gets
    the result (the slowest rank's medians), the others None."""
    setup = _prepare(cfg, runtime)
    for i in range(warmup):
        _timed_step(setup, i)
    comm.barrier()
    synced = [_timed_step(setup, i)[0] for i in range(steps)]
    comm.barrier()
    local = (
        [_timed_step(setup, i, synced=False)[0] for i in range(steps)]
        if runtime.world_size > 1
        else synced
    )
    medians = {name: statistics.median(t[name] for t in synced) for name in PHASES}
    total = statistics.median(sum(t.values()) for t in synced)
    no_sync_total = statistics.median(sum(t.values()) for t in local)
    mine = {
        **medians,
        "step": total,
        "no_sync": no_sync_total,
        "mem": _peak_memory_mb(runtime.device),
    }
    every = comm.all_gather_object(mine)
    if not runtime.is_main:
        return None
    slowest = {key: max(r[key] for r in every) for key in mine}
    per_process = cfg.batch_size / slowest["step"]
    return BenchResult(
        model=cfg.model,
        image_size=cfg.image_size,
        batch_size=cfg.batch_size,
        world_size=runtime.world_size,
        precision=setup.precision.mode,
        device=runtime.device.type,
        steps=steps,
        step_ms=1000 * slowest["step"],
        no_sync_step_ms=1000 * slowest["no_sync"],
        communication_ms=1000 * max(0.0, slowest["step"] - slowest["no_sync"]),
        data_ms=1000 * slowest["data"],
        forward_ms=1000 * slowest["forward"],
        backward_ms=1000 * slowest["backward"],
        optimizer_ms=1000 * slowest["optimizer"],
        images_per_s_per_process=per_process,
        images_per_s=per_process * runtime.world_size,
        peak_memory_mb=slowest["mem"],
    )


def gradient_order(
    cfg: TrainConfig, runtime: Runtime, steps: int, warmup: int
) -> list[tuple[float, int]]:
    """When each gradient is ready, as a share of backward (median of ``steps`` steps),
    and its bytes on the wire, in the order backward produces them: what the cost model
    needs to place DDP's buckets inside backward."""
    setup = _prepare(cfg, runtime)
    params = [p for p in setup.parts.parameters() if p.requires_grad]
    ready: dict[int, list[float]] = {i: [] for i in range(len(params))}

    def recorder(index: int):
        def hook(_param: torch.Tensor) -> None:
            _sync(setup.device)
            ready[index].append(time.perf_counter())

        return hook

    for i in range(warmup):
        _timed_step(setup, i, synced=False)
    handles = [p.register_post_accumulate_grad_hook(recorder(i)) for i, p in enumerate(params)]
    for i in range(steps):
        times, backward_start = _timed_step(setup, i, synced=False)
        for seen in ready.values():
            if len(seen) == i + 1:  # a share of this step's backward (hooks slow it alike)
                seen[-1] = (seen[-1] - backward_start) / times["backward"]
    for handle in handles:
        handle.remove()
    element = 2 if cfg.grad_compression in ("fp16", "bf16") else 4
    return sorted(
        (statistics.median(ready[i]), params[i].numel() * element) for i in ready if ready[i]
    )


def format_result(result: BenchResult) -> str:
    """The lines `paratrain bench` prints: images/s, the step by phase, communication and peak memory."""
    r = asdict(result)
    lines = [
        f"{r['model']} at {r['image_size']}px, batch {r['batch_size']} x {r['world_size']} "
        f"process(es) on {r['device']}, precision {r['precision']}, median of {r['steps']} steps",
        f"  images/s: {r['images_per_s']:.1f} in total, {r['images_per_s_per_process']:.1f} "
        "per process",
        f"  step {r['step_ms']:.1f} ms = data {r['data_ms']:.1f} + forward {r['forward_ms']:.1f}"
        f" + backward {r['backward_ms']:.1f} + optimizer {r['optimizer_ms']:.1f}",
        f"  communication {r['communication_ms']:.1f} ms (synced step minus no_sync step "
        f"{r['no_sync_step_ms']:.1f} ms)",
        f"  peak memory {r['peak_memory_mb']:.0f} MB",
    ]
    return "\n".join(lines)
