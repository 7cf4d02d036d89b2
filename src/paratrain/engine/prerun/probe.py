"""Training steps on synthetic batches: the run's own model, strategy, optimizer and
recipe, timed (`paratrain bench`, and --budget's choice of recipe before a run).

The model is a copy built for the probe alone, so the run's weights and BatchNorm
statistics never see a synthetic batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from paratrain.config import TrainConfig
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run import precision as precision_module
from paratrain.engine.run.recipe import build_optimizer, build_recipe
from paratrain.engine.run.step import Stepper, train_step
from paratrain.parallel.parallelize import build_parts
from paratrain.parallel.parts import ModelParts


@dataclass
class Probe:
    stepper: Stepper
    pool: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a clock read after it is the work's end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare(cfg: TrainConfig, runtime: Runtime, classes: int = 10) -> Probe:
    """The run's own model, strategy, optimizer and recipe, and a pool of synthetic
    batches at the training size already on the device."""
    # steps under no_sync split out the communication: for DDP that is what gradient
    # accumulation does (no static graph, see parallel/ddp.py)
    accumulating = replace(cfg, grad_accum=2)
    parts = build_parts(accumulating, classes, runtime)
    size = cfg.train_size
    pool = [
        (
            torch.randn(cfg.batch, 3, size, size, device=runtime.device).to(
                memory_format=parts.memory_format
            ),
            torch.randint(0, classes, (cfg.batch,), device=runtime.device),
        )
        for _ in range(2)
    ]
    parts.train()
    return Probe(stepper_for(cfg, parts, runtime, classes), pool, runtime.device)


def stepper_for(cfg: TrainConfig, parts: ModelParts, runtime: Runtime, classes: int) -> Stepper:
    """The run's precision, recipe and optimizer on ``parts`` as one Stepper, in the
    training loop's order (an EMA copies the model before precision prepares it)."""
    precision = precision_module.build(cfg, runtime)
    recipe = build_recipe(cfg, parts, classes, precision)
    precision.prepare(parts)
    return Stepper(parts, build_optimizer(parts, cfg, runtime.world_size), recipe)


def step_seconds(
    cfg: TrainConfig, runtime: Runtime, steps: int = 3, warmup: int = 1
) -> tuple[float, int]:
    """The median of ``steps`` synced training steps after ``warmup``, the slowest
    rank's, on every rank (every rank takes part: the steps all-reduce); and the
    model's replicas (the processes that each train a share of a batch). After the
    first step, which allocates, the median of three is within a tenth of the steps
    that follow (ResNet-18 at 64 px, 2 processes on 2 cores)."""
    probe = prepare(cfg, runtime)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        train_step(probe.stepper, [probe.pool[i % len(probe.pool)]], 1)
        sync(probe.device)
        times.append(time.perf_counter() - start)
    mine = statistics.median(times[warmup:])
    replicas = probe.stepper.parts.replicas
    del probe
    return max(comm.all_gather_object(mine)), replicas
