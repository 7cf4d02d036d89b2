"""`paratrain plan`: memory per device for every strategy, which fit, which to use.

The estimate, per device (weights, gradients and optimizer state in fp32):

- parameters P, gradients P, optimizer state k·P (SGD with momentum k = 1, AdamW k = 2);
- under autocast, the half-size copies of the weights its forward makes and keeps for
  backward (P/2 under bf16, where the strategy computes with fp32 weights);
- activations: what autograd saves for backward, measured unit by unit in one step at a
  batch of 2 (partition.profile) and scaled linearly to the batch, at its most during
  backward (MemoryProfile.saved), plus the largest unit's activations again as
  backward's workspace (the gradient flowing through it). One process alone (no DDP,
  whose buckets hold the gradients all step) frees its gradients every step and makes
  them again during backward, unit by unit as activations are given back: the peak
  of the two together is less than their sum (MemoryProfile.freed_gradients);
- on a CPU, the math library's scratch in a convolution's backward: the largest weight
  reordered for the backward-data kernel, and a partial weight gradient for each
  thread after the first (MemoryProfile.scratch).

Each strategy divides these its own way (its ``memory``, parallel/<name>.py): the whole
model on every device, 1/N of every tensor plus the blocks gathered for compute, or one
stage's weights and that stage's activations.

Measured, to check it: :func:`peak_rss` reads the process's peak resident memory
(VmHWM) around a training step, reset first through /proc/self/clear_refs, with glibc's
malloc made to give every freed tensor back at once (:func:`tensors_unmapped_when_freed`),
so that the peak is the tensors' own and not the allocator's leftovers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn

from paratrain.config import PlanOptions, TrainConfig
from paratrain.engine.run.recipe import wants_average
from paratrain.errors import UserError
from paratrain.parallel import STRATEGIES, partition
from paratrain.parallel.base import DeviceMemory, MemoryProfile
from paratrain.parallel.base import get as strategy_of

PROFILE_BATCH = 2


def parse_size(text: str) -> int:
    """'16GB', '16GiB', '512MB', '80G' or a number of GB -> bytes (GB taken as GiB, as
    device memory is quoted)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not match:
        raise UserError(f"--device-memory: not a size: {text!r} (e.g. 16GB, 80GiB, 512MB)")
    scale = {"": 2**30, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[match[2].lower()]
    value = float(match[1]) * scale
    if value <= 0:
        raise UserError(f"--device-memory must be positive, got {text!r}")
    return int(value)


def estimate(
    model: nn.Module,
    image_size: int,
    batch: int,
    devices: int,
    slots: int,
    microbatches: int = 4,
    schedule: str = "1f1b",
    model_name: str = "model",
    autocast: torch.dtype | None = None,
    teacher: nn.Module | None = None,
    checkpointed: bool = False,
    averaged: bool = False,
    threads: int = 0,
) -> list[DeviceMemory]:
    """The most any one device needs, for each strategy at ``devices`` devices (each
    strategy's own estimate, parallel/<name>.py), fastest first; activations as saved
    under ``autocast`` (the run's mixed precision), weights and optimizer state fp32.
    With a ``teacher`` (--teacher), its fp32 weights as each strategy places them, and
    only the strategies that take one. ``checkpointed`` (--activation-checkpointing):
    the repeated blocks keep their inputs only, and only the strategies that take it.
    ``averaged`` (--ema-decay, on by default): a copy of the weights and buffers on the
    strategies that keep one. ``threads``: the CPU threads each process computes with,
    on a CPU (0: on a GPU, where no CPU kernel's scratch is held)."""
    from paratrain.parallel.regions import repeated_blocks

    sample = partition.sample_images(image_size, PROFILE_BATCH)
    traced, starts = partition.plan_stages(
        model, devices, sample, model_name=model_name, autocast=autocast
    )
    blocks = frozenset(name for name, _ in repeated_blocks(model)) if checkpointed else frozenset()
    profile = MemoryProfile(
        model, traced, starts, batch, PROFILE_BATCH, devices, slots, microbatches, schedule,
        checkpointing=checkpointed, checkpointed=blocks & set(traced.names), threads=threads,
        compute_bytes=torch.finfo(autocast).bits // 8 if autocast else 4,
    )  # fmt: skip
    rows = [row for name in STRATEGIES if (row := strategy_of(name).planned(profile)) is not None]
    if teacher is not None:
        weights = sum(p.numel() * 4 for p in teacher.parameters())
        placed = [(row, strategy_of(row.strategy).teacher_bytes(weights, devices)) for row in rows]
        rows = [replace(row, teacher=size) for row, size in placed if size is not None]
    if averaged:
        copy = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        rows = [replace(row, average=copy) if strategy_of(row.strategy).keeps_average else row
                for row in rows]  # fmt: skip
    return sorted(rows, key=lambda row: strategy_of(row.strategy).speed_order)


def teacher_of(cfg: TrainConfig, classes: int) -> nn.Module | None:
    """--teacher's shapes (on the meta device: nothing allocated), for the estimate."""
    if cfg.teacher is None:
        return None
    from paratrain.models.registry import create_model

    with torch.device("meta"):
        return create_model(cfg.teacher, classes, cfg.image_size)


def cpu_threads(cfg: TrainConfig, devices: int) -> int:
    """The threads each of ``devices`` processes computes with where the run is on CPUs
    (the estimate's ``threads``); 0 where it is on GPUs."""
    from paratrain.distributed.runtime import runs_on_cuda, threads_per_process

    return 0 if runs_on_cuda(cfg.device) else threads_per_process(devices)


def fits(row: DeviceMemory, device_memory: int, devices: int) -> bool:
    """Within the device's memory, and possible there (one device: a whole model)."""
    return row.total <= device_memory and devices >= strategy_of(row.strategy).min_devices


def recommend(rows: list[DeviceMemory], device_memory: int, devices: int) -> tuple[str | None, str]:
    """The fastest strategy that fits ``device_memory`` (rows come fastest first) and
    why; where none fits, the one that needs least."""
    for row in rows:
        if fits(row, device_memory, devices):
            return row.strategy, strategy_of(row.strategy).why
    least = min(rows, key=lambda r: r.total)
    return None, (
        f"nothing fits {_gib(device_memory)} per device; the least is {least.strategy} at "
        f"{_gib(least.total)}: use more devices, a smaller --batch-size, bf16 "
        f"(activations about half), or --activation-checkpointing (ddp, fsdp, hsdp)"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_plan(
    rows: list[DeviceMemory],
    device_memory: int,
    devices: int,
    choice: str | None,
    why: str,
    heading: str,
) -> str:
    """The table `paratrain plan` prints: each strategy's memory per device, whether it fits, and the recommendation."""
    lines = [
        heading,
        f"{'strategy':<9} {'params':>9} {'grads':>9} {'optim':>9} "
        f"{'activ.':>9} {'total':>10}  fits {_gib(device_memory)}",
    ]
    for r in rows:
        verdict = "yes" if fits(r, device_memory, devices) else "no"
        needs = strategy_of(r.strategy).min_devices
        if devices < needs:
            verdict = f"no (needs {needs}+ devices)"
        taught = f"; the teacher {_mib(r.teacher).strip()}" if r.teacher else ""
        taught += f"; the EMA weights {_mib(r.average).strip()}" if r.average else ""
        taught += f"; autocast's weight copies {_mib(r.cast).strip()}" if r.cast else ""
        taught += f"; the CPU kernels' scratch {_mib(r.scratch).strip()}" if r.scratch else ""
        lines.append(
            f"{r.strategy:<9} {_mib(r.parameters)} {_mib(r.gradients)} {_mib(r.optimizer)} "
            f"{_mib(r.activations)} {_gib(r.total):>10}  {verdict}  ({r.detail}{taught})"
        )
    lines.append(f"recommended: {choice} — {why}" if choice else f"recommended: none — {why}")
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:>6.0f} MiB"


def as_dict(rows: list[DeviceMemory]) -> list[dict]:
    """The rows as plain dicts, for --json."""
    return [{**asdict(r), "total": r.total} for r in rows]


def _status_bytes(field: str) -> int | None:
    path = Path("/proc/self/status")
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def peak_rss(run: Callable[[], object]) -> int | None:
    """Bytes by which this process's peak resident memory rose above its resident memory
    before ``run`` (Linux; None where the peak cannot be reset)."""
    before = _status_bytes("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    run()
    peak = _status_bytes("VmHWM")
    return None if before is None or peak is None else peak - before


def tensors_unmapped_when_freed() -> None:
    """glibc's malloc maps every block of 128 KiB or more on its own and unmaps it when
    freed. By default that threshold rises as such blocks are freed, after which
    tensors land in the heap, whose freed space stays resident: ResNet-50's checkpointed
    step (128 px, batch 16) then peaked anywhere from 614 to 766 MB on one machine,
    against 489 MB, to within 0.1%, with the threshold held. Nothing where glibc is not."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; fixing it stops its rise


def measure_training_peak(
    model_name: str,
    image_size: int,
    batch: int,
    opt: str = "sgd",
    classes: int = 1000,
    precision: str = "32",
    checkpointed: bool = False,
) -> int | None:
    """Peak resident memory a plain training run adds (fp32, or its forward under
    ``precision``'s autocast): build the model and optimizer, take two steps (the
    optimizer state exists from the first); ``checkpointed``: its repeated blocks under
    activation checkpointing. Run it in a fresh process: memory a process freed earlier
    may be reused and go uncounted."""
    import contextlib

    tensors_unmapped_when_freed()

    dtype = AUTOCAST.get(precision)

    def cast() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()

    from paratrain.models.registry import create_model

    x = torch.randn(batch, 3, image_size, image_size)
    y = torch.randint(0, classes, (batch,))
    warm = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, classes),
    )
    nn.functional.cross_entropy(warm(x), y).backward()  # kernels' own setup: not the model's
    del warm

    def train() -> None:
        model = create_model(model_name, classes, image_size)
        if checkpointed:
            from paratrain.parallel.regions import checkpoint_activations, repeated_blocks

            checkpoint_activations(repeated_blocks(model))
        optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-3)
            if opt == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        )
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            with cast():
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

    return peak_rss(train)


def available_memory() -> int:
    """This machine's available memory (Linux's MemAvailable; 8 GiB where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def this_machine(opts: PlanOptions) -> PlanOptions:
    """The options with what was not given taken from this machine: its GPUs and one
    GPU's memory, or (no GPU) 2 devices sharing the available memory."""
    from dataclasses import replace

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = opts.devices or gpus or 2
    memory = opts.device_memory
    if memory is None:
        each = (
            torch.cuda.get_device_properties(0).total_memory
            if gpus
            else available_memory() // devices
        )
        memory = f"{each / 2**30:.1f}GiB"
    return replace(opts, devices=devices, device_memory=memory)


def plan(cfg: TrainConfig, opts: PlanOptions) -> tuple[dict, str]:
    """`paratrain plan`: the estimate as a dict (--json) and as the table, for the model
    profiled once on the CPU."""
    from paratrain.models.registry import create_model

    given = opts.device_memory is not None
    opts = this_machine(opts)
    assert opts.devices is not None
    limit = parse_size(opts.device_memory or "")
    mode, how = run_precision(cfg)
    torch.manual_seed(0)
    net = create_model(cfg.model, opts.classes, cfg.image_size)
    rows = estimate(
        net,
        cfg.image_size,
        cfg.batch,
        opts.devices,
        partition.optimizer_slots(cfg.opt, cfg.momentum),
        cfg.microbatches,
        cfg.schedule,
        model_name=cfg.model,
        autocast=AUTOCAST.get(mode),
        teacher=teacher_of(cfg, opts.classes),
        checkpointed=cfg.activation_checkpointing,
        averaged=wants_average(cfg),
        threads=cpu_threads(cfg, opts.devices),
    )
    choice, why = recommend(rows, limit, opts.devices)
    result = {
        "model": cfg.model,
        "image_size": cfg.image_size,
        "batch_size": cfg.batch,
        "devices": opts.devices,
        "device_memory": limit,
        "precision": mode,
        "activation_checkpointing": cfg.activation_checkpointing,
        "rows": as_dict(rows),
        "recommended": choice,
        "why": why,
    }
    mine = "" if given else " (this machine's; --device-memory for another)"
    heading = (
        f"{cfg.model} at {cfg.image_size}px, batch {cfg.batch} per device, "
        f"{cfg.opt}, {mode} ({how}), {opts.devices} device(s) of {opts.device_memory}{mine}"
        f"{', activation checkpointing' if cfg.activation_checkpointing else ''}:"
    )
    return result, format_plan(rows, limit, opts.devices, choice, why, heading)


# the dtype a run's forward computes in under each --precision (16-mixed is profiled as
# bf16 on a CPU: the same two bytes an element)
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.bfloat16}


def run_precision(cfg: TrainConfig) -> tuple[str, str]:
    """The precision a run on this machine would train in (--precision auto resolved
    as training resolves it, for its GPUs or else its CPU), and how it was chosen."""
    from paratrain.distributed.runtime import resolve_precision

    if cfg.precision != "auto":
        return cfg.precision, "--precision"
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    return resolve_precision("auto", device), "what a run here would use"


def check_plan(cfg: TrainConfig, opts: PlanOptions) -> None:
    """What `paratrain plan` can be found wrong about before profiling anything."""
    from paratrain.models.registry import check_input_size

    if opts.device_memory is not None:
        parse_size(opts.device_memory)
    check_input_size(cfg.model, cfg.image_size)


def describe_plan(cfg: TrainConfig, opts: PlanOptions) -> str:
    """What `plan --dry-run` says would run."""
    opts = this_machine(opts)
    return (
        f"would profile {cfg.model} at {cfg.image_size}px in {run_precision(cfg)[0]} and "
        f"plan batch {cfg.batch_size} on {opts.devices} device(s) of {opts.device_memory}"
    )
