"""`paratrain bench`: training-step speed on synthetic data already on the device.

The step timed is the training loop's own (engine/run/step.py), with the run's strategy,
optimizer and precision. Each is split into data (taking the next batch from a pool on
the device), forward, backward and optimizer. With DDP the backward pass also carries the gradient
all-reduce, overlapped with it; communication is measured as the median synced step
minus the median step of the same work under ``no_sync`` (gradients kept local).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from paratrain.config import BenchOptions, TrainConfig
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime
from paratrain.engine.prerun.probe import Probe, prepare, sync
from paratrain.engine.run.step import train_step

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


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _timed_step(setup: Probe, index: int, synced: bool = True) -> tuple[dict[str, float], float]:
    """One training step (engine/run/step.py); seconds per phase, and the clock when
    backward started."""
    times: dict[str, float] = {}
    mark = time.perf_counter()
    started: list[float] = []

    def lap(name: str) -> None:
        nonlocal mark
        sync(setup.device)
        now = time.perf_counter()
        times[name] = times.get(name, 0.0) + now - mark
        mark = now
        if name == "forward":
            started.append(now)

    batch = setup.pool[index % len(setup.pool)]
    train_step(setup.stepper, [batch], 1, sync=synced, lap=lap)
    for phase in PHASES:
        times.setdefault(phase, 0.0)
    return times, started[0] if started else mark


def run_bench(cfg: TrainConfig, runtime: Runtime, steps: int, warmup: int) -> BenchResult | None:
    """Time ``steps`` training steps after ``warmup``; every rank takes part, rank 0 gets
    the result (the slowest rank's medians), the others None."""
    setup = prepare(cfg, runtime)
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
    per_process = cfg.batch / slowest["step"]
    return BenchResult(
        model=cfg.model,
        image_size=cfg.image_size,
        batch_size=cfg.batch,
        world_size=runtime.world_size,
        precision=setup.stepper.recipe.precision.mode,
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
    setup = prepare(cfg, runtime)
    params = [p for p in setup.stepper.parts.parameters() if p.requires_grad]
    ready: dict[int, list[float]] = {i: [] for i in range(len(params))}

    def recorder(index: int):
        def hook(_param: torch.Tensor) -> None:
            sync(setup.device)
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


def bench_worker(cfg: TrainConfig, opts: BenchOptions, env: DistEnv) -> BenchResult | None:
    """This process's share of `paratrain bench`: the timed steps, and with
    ``sweep_bytes`` all-reduce timings up to that size; ``result_file`` receives both
    as JSON (how `paratrain scale` collects the runs it launches)."""
    from paratrain.bench.collectives import sweep_all_reduce
    from paratrain.distributed.runtime import distributed

    with distributed(env, cfg.device, cfg.backend, cfg.timeout) as runtime:
        result = run_bench(cfg, runtime, opts.steps, opts.warmup)
        sweep = None
        if opts.sweep_bytes and runtime.world_size > 1:
            sweep = sweep_all_reduce(opts.sweep_bytes)
    if opts.result_file and result is not None:
        Path(opts.result_file).write_text(
            json.dumps({"bench": asdict(result), "all_reduce": sweep})
        )
    return result


def describe_bench(cfg: TrainConfig, opts: BenchOptions) -> str:
    """What `bench --dry-run` says would run."""
    return (
        f"would time {opts.steps} steps (after {opts.warmup}) of {cfg.model} at "
        f"{cfg.image_size}px, batch {cfg.batch_size} x {cfg.nproc} process(es)"
    )


def budget_plan(cfg: TrainConfig, train: int, val: int, world: int) -> str:
    """--budget in a dry run: the epochs that would fit, from a few steps timed here on
    synthetic batches in one process (the run times its own first steps and plans
    again every epoch)."""
    from paratrain.distributed.runtime import distributed
    from paratrain.engine.prerun.budget import (
        SHORT,
        SMALLEST,
        concrete,
        duration,
        epoch_seconds,
        low_res,
        may_choose,
        recipe_words,
    )

    probe = replace(concrete(cfg), nproc=1, strategy="ddp", weights=None, freeze_epochs=0)
    with distributed(DistEnv(), cfg.device, None, cfg.timeout) as runtime:
        result = run_bench(probe, runtime, steps=3, warmup=1)
    assert result is not None  # the one process is rank 0
    step = result.step_ms / 1000
    steps = -(-train // (probe.batch * world))
    seconds = cfg.budget_seconds or 0.0
    epochs = seconds / max(epoch_seconds(step, probe, train, val, world), 1e-9)
    recipe = ""
    if cfg.budget_recipe == "low-res":
        recipe = f"; --budget-recipe low-res: {recipe_words(cfg)}"
    elif may_choose(cfg) and epochs < SHORT and low_res(cfg).train_size >= SMALLEST:
        recipe = (
            f"; under {SHORT:.0f}, so the run would likely choose --budget-recipe low-res "
            f"(it times its own steps to decide): {recipe_words(cfg)}"
        )
    return (
        f"--budget {duration(seconds)}: at most about {epochs:.1f} epochs at "
        f"{probe.train_size} px ({step * 1000:.0f} "
        f"ms a step measured here in one process on synthetic batches, {steps} steps an "
        "epoch; loading, evaluation and saving add to it): the run times its own first "
        f"steps and plans again every epoch{recipe}"
    )
