"""`paratrain plan`: memory per device for every strategy, which fit, which to use.

The estimate, per device, for fp32 training:

- parameters P, gradients P, optimizer state k·P (SGD with momentum k = 1, AdamW k = 2);
- activations: what autograd saves for backward, measured unit by unit in one step at a
  batch of 2 (partition.profile) and scaled linearly to the batch, plus the largest
  unit's activations again as backward's workspace (the gradient flowing through it).

Strategies divide these differently: ddp holds everything on every device; fsdp divides
P, gradients and optimizer state by N but gathers a block whole for its compute and the
next one ahead (the two largest blocks are counted); split and pipeline give each device
one stage's weights and that stage's activations — all of the batch for split and GPipe, at most P - s micro-batches in flight
on stage s under 1F1B.

Measured, to check it: :func:`peak_rss` reads the process's peak resident memory
(VmHWM) around a training step, reset first through /proc/self/clear_refs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.parallel import fsdp, partition

PROFILE_BATCH = 2
ORDER = ("ddp", "fsdp", "pipeline", "split")  # fastest first, where the model fits
WHY = {
    "ddp": "the whole model on every device: no parameter traffic, and the gradient "
    "all-reduce overlaps the backward pass",
    "fsdp": "parameters, gradients and optimizer state sharded N ways; each block's "
    "parameters are all-gathered for its forward and backward (about 1.5x DDP's traffic)",
    "pipeline": "one stage per device, micro-batches in flight; the pipeline's fill and "
    "drain leave each device idle (P-1)/(M+P-1) of the time",
    "split": "one stage per device in one process: only one device computes at a time",
}


@dataclass
class DeviceMemory:
    strategy: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    detail: str = ""

    @property
    def total(self) -> int:
        """Bytes per device in all."""
        return self.parameters + self.gradients + self.optimizer + self.activations


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
) -> list[DeviceMemory]:
    """The most any one device needs, for each strategy at ``devices`` devices."""
    sample = partition.sample_images(image_size, PROFILE_BATCH)
    traced, starts = partition.plan_stages(model, devices, sample, model_name=model_name)
    scale = batch / PROFILE_BATCH
    units = traced.units
    params = sum(u.parameter_bytes for u in units)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    saved = sum(u.activation_bytes for u in units) * scale
    workspace = max(u.activation_bytes for u in units) * scale
    rows = [
        DeviceMemory(
            "ddp",
            params,
            trainable,
            slots * trainable,
            int(saved + workspace),
            f"batch {batch} per device",
        ),
    ]
    gathered = sum(sorted((_bytes(b) for b in fsdp.blocks(model)), reverse=True)[:2])
    sharded = lambda n: n // devices  # noqa: E731
    rows.append(
        DeviceMemory(
            "fsdp",
            sharded(params) + gathered,
            sharded(trainable),
            sharded(slots * trainable),
            int(saved + workspace),
            f"1/{devices} of each tensor, plus the two largest blocks gathered whole "
            "(one computing, one prefetched)",
        )
    )
    stages = partition.stage_units(traced, starts)
    for strategy in ("pipeline", "split"):
        worst = None
        for index, stage in enumerate(stages):
            weights = sum(u.parameter_bytes for u in stage)
            acts = sum(u.activation_bytes for u in stage) * scale
            if strategy == "pipeline" and schedule == "1f1b":
                acts *= min(microbatches, len(stages) - index) / microbatches
            space = max(u.activation_bytes for u in stage) * scale
            if strategy == "pipeline":
                space /= microbatches
            row = DeviceMemory(
                strategy,
                weights,
                weights,
                slots * weights,
                int(acts + space),
                f"stage {index} of {len(stages)} is the largest",
            )
            if worst is None or row.total > worst.total:
                worst = row
        if strategy == "pipeline":
            worst.detail += f", {microbatches} micro-batches, {schedule}"
        rows.append(worst)
    return rows


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def fits(row: DeviceMemory, device_memory: int, devices: int) -> bool:
    """Within the device's memory, and possible there (one device: only ddp's layout)."""
    return row.total <= device_memory and (devices > 1 or row.strategy == "ddp")


def recommend(rows: list[DeviceMemory], device_memory: int, devices: int) -> tuple[str | None, str]:
    """The fastest strategy that fits ``device_memory`` (in the order of ORDER) and why; where none fits, the one that needs least."""
    fitting = {r.strategy for r in rows if fits(r, device_memory, devices)}
    for strategy in ORDER:
        if strategy in fitting:
            return strategy, WHY[strategy]
    least = min(rows, key=lambda r: r.total)
    return None, (
        f"nothing fits {_gib(device_memory)} per device; the least is {least.strategy} at "
        f"{_gib(least.total)}: use more devices, a smaller --batch-size, or bf16 "
        f"(activations about half)"
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
        if devices < 2 and r.strategy != "ddp":
            verdict = "no (needs 2+ devices)"
        lines.append(
            f"{r.strategy:<9} {_mib(r.parameters)} {_mib(r.gradients)} {_mib(r.optimizer)} "
            f"{_mib(r.activations)} {_gib(r.total):>10}  {verdict}  ({r.detail})"
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


def measure_training_peak(
    model_name: str, image_size: int, batch: int, opt: str = "sgd", classes: int = 1000
) -> int | None:
    """Peak resident memory a plain fp32 training run adds: build the model and optimizer,
    take two steps (the optimizer state exists from the first). Run it in a fresh process:
    memory a process freed earlier may be reused and go uncounted."""
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
        optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-3)
            if opt == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        )
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    return peak_rss(train)
