"""One typed configuration tree.

CLI flags and YAML files both map onto :class:`TrainConfig`; the resolved config is
written to the run directory as ``config.yaml`` (like timm's ``args.yaml``). Unknown
keys and wrong types are errors, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from paratrain.errors import UserError


@dataclass
class TrainConfig:
    # data
    data: str | None = None
    val_fraction: float = 0.2
    split_seed: int = 0
    image_size: int = 224
    crop_scale_min: float = 0.08
    hflip: float = 0.5
    workers: int | None = None
    bad_images: str = "error"
    cache: str = "auto"
    cache_max_gb: float = 4.0
    # model
    model: str = "resnet18"
    weights: str | None = None
    weights_strict: bool = False
    # optimisation
    epochs: int = 10
    batch_size: int = 16
    lr: float = 0.01
    lr_scaling: str = "linear"
    lrf: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.005
    warmup_epochs: int = 0
    seed: int = 0
    opt: str = "sgd"
    label_smoothing: float = 0.0
    ema_decay: float | None = None
    mixup: float = 0.0
    cutmix: float = 0.0
    freeze_backbone: bool = False
    # speed
    precision: str = "auto"
    grad_accum: int = 1
    clip_grad: float | None = None
    grad_compression: str = "none"
    bucket_cap_mb: float = 25.0
    memory_format: str = "auto"
    compile: bool = False
    # parallelism
    nproc: int = 1
    strategy: str = "ddp"
    devices: str | None = None  # split: comma-separated devices, one stage each
    stages: int = 2  # pipeline: stages (processes) per model replica
    microbatches: int = 4  # pipeline: micro-batches each batch is cut into
    schedule: str = "1f1b"  # pipeline: gpipe or 1f1b
    split_points: str | None = None  # split, pipeline: units where stages 2.. begin
    sync_bn: bool = False
    backend: str | None = None
    device: str | None = None
    timeout: float = 600.0
    max_restarts: int = 0
    master_port: int | None = None
    # failures and checkpoints
    keep: int = 0
    save_every_steps: int = 0
    deterministic: bool = False
    on_nonfinite: str = "abort"
    requeue: bool = False
    preempt_grace: float = 20.0
    # output
    output_dir: str = "runs"
    name: str | None = None
    resume: str | None = None
    tensorboard: bool = False
    # where --data is absent: the embedded digits set; filled in by resolve_defaults()
    cache_dir: str | None = None

    def validate(self) -> TrainConfig:
        """Check values a user can get wrong; raise UserError naming flag and value."""
        _at_least("--nproc", self.nproc, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--epochs", self.epochs, 1)
        _at_least("--image-size", self.image_size, 8)
        _at_least("--warmup-epochs", self.warmup_epochs, 0)
        if self.workers is not None:
            _at_least("--workers", self.workers, 0)
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(f"--val-fraction must be between 0 and 1, got {self.val_fraction}")
        if not 0.0 < self.crop_scale_min <= 1.0:
            raise UserError(f"--crop-scale-min must be in (0, 1], got {self.crop_scale_min}")
        if not 0.0 <= self.hflip <= 1.0:
            raise UserError(f"--hflip must be a probability in [0, 1], got {self.hflip}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.lrf <= 1.0:
            raise UserError(f"--lrf must be in [0, 1], got {self.lrf}")
        if self.lr_scaling not in ("linear", "none"):
            raise UserError(f"--lr-scaling must be 'linear' or 'none', got {self.lr_scaling!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise UserError(f"--backend must be 'gloo' or 'nccl', got {self.backend!r}")
        _at_least("--max-restarts", self.max_restarts, 0)
        _at_least("--keep", self.keep, 0)
        _at_least("--save-every-steps", self.save_every_steps, 0)
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise UserError(
                f"--master-port must be a port number (1-65535), got {self.master_port}"
            )
        if self.bad_images not in ("error", "skip"):
            raise UserError(f"--bad-images must be 'error' or 'skip', got {self.bad_images!r}")
        if self.cache not in ("auto", "on", "off"):
            raise UserError(f"--cache must be auto, on or off, got {self.cache!r}")
        if self.on_nonfinite not in ("abort", "skip"):
            raise UserError(f"--on-nonfinite must be 'abort' or 'skip', got {self.on_nonfinite!r}")
        if self.strategy not in STRATEGIES:
            raise UserError(
                f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        self._validate_partitioning()
        if self.strategy == "dp" and self.nproc > 1:
            raise UserError(
                "--strategy dp drives every GPU from one process; leave out --nproc "
                "(or use --strategy ddp, one process per GPU)"
            )
        if self.precision not in ("auto", "32", "bf16-mixed", "16-mixed"):
            raise UserError(
                f"--precision must be auto, 32, bf16-mixed or 16-mixed, got {self.precision!r}"
            )
        _at_least("--grad-accum", self.grad_accum, 1)
        if self.clip_grad is not None and not (
            self.clip_grad > 0 and math.isfinite(self.clip_grad)
        ):
            raise UserError(f"--clip-grad must be a positive norm, got {self.clip_grad}")
        if self.grad_compression not in ("none", "fp16", "bf16", "powersgd"):
            raise UserError(
                "--grad-compression must be none, fp16, bf16 or powersgd, "
                f"got {self.grad_compression!r}"
            )
        if self.memory_format not in ("auto", "channels_last", "contiguous"):
            raise UserError(
                "--memory-format must be auto, channels_last or contiguous, "
                f"got {self.memory_format!r}"
            )
        if not self.bucket_cap_mb > 0:
            raise UserError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        if self.opt not in ("sgd", "adamw"):
            raise UserError(f"--opt must be 'sgd' or 'adamw', got {self.opt!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise UserError(f"--ema-decay must be between 0 and 1, got {self.ema_decay}")
        for flag, alpha in (("--mixup", self.mixup), ("--cutmix", self.cutmix)):
            if not (alpha >= 0.0 and math.isfinite(alpha)):
                raise UserError(f"{flag} is a Beta(alpha, alpha) parameter >= 0, got {alpha}")
        if self.timeout <= 0:
            raise UserError(f"--timeout must be positive, got {self.timeout}")
        return self

    def _validate_partitioning(self) -> None:
        _at_least("--stages", self.stages, 2)
        _at_least("--microbatches", self.microbatches, 1)
        if self.schedule not in ("gpipe", "1f1b"):
            raise UserError(f"--schedule must be gpipe or 1f1b, got {self.schedule!r}")
        if self.strategy == "split" and self.nproc > 1:
            raise UserError(
                "--strategy split runs in one process over --devices; leave out --nproc "
                "(--strategy pipeline runs stages in separate processes)"
            )
        if (
            self.strategy == "pipeline"
            and self.schedule == "1f1b"
            and self.microbatches < self.stages
        ):
            raise UserError(
                f"--schedule 1f1b needs at least as many micro-batches as stages "
                f"(--microbatches {self.microbatches}, --stages {self.stages})"
            )
        if self.strategy == "pipeline" and self.batch_size % self.microbatches:
            raise UserError(
                f"--batch-size {self.batch_size} must divide into --microbatches "
                f"{self.microbatches} equal micro-batches"
            )
        partitioned = self.strategy in ("split", "pipeline", "fsdp")
        for flag, on in (
            ("--ema-decay", self.ema_decay is not None),
            ("--compile", self.compile),
            ("--grad-compression", self.grad_compression != "none"),
        ):
            if partitioned and on:
                raise UserError(f"{flag} works with --strategy ddp, not {self.strategy}")
        if self.strategy in ("split", "pipeline") and self.sync_bn:
            raise UserError(f"--sync-bn works with --strategy ddp or fsdp, not {self.strategy}")
        if self.strategy in ("pipeline", "fsdp") and self.precision == "16-mixed":
            raise UserError(
                f"--precision 16-mixed (a GradScaler) is not supported with --strategy "
                f"{self.strategy}; use bf16-mixed or 32"
            )

    def split_point_list(self) -> list[str] | None:
        """--split-points as a list of unit names (None: balance automatically)."""
        if not self.split_points:
            return None
        return [point.strip() for point in self.split_points.split(",") if point.strip()]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> TrainConfig:
        """Build a config from a mapping; unknown keys and wrong types are UserErrors."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(f"{source}: unknown key(s) {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        checked = {k: _coerce(k, v, hints[k], source) for k, v in values.items()}
        return cls(**checked)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file not found: {path}")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise UserError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
        if not isinstance(values, dict):
            raise UserError(f"{path}: expected a mapping of config keys")
        return cls.from_dict(values, source=str(path))


STRATEGIES = ("ddp", "dp", "fsdp", "split", "pipeline")


def _at_least(flag: str, value: int, low: int) -> None:
    if value < low:
        raise UserError(f"{flag} must be at least {low}, got {value}")


def _coerce(key: str, value: Any, hint: Any, source: str) -> Any:
    """Accept a value if it fits the annotated type (ints are fine where floats are)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        base = typing.get_origin(option) or option
        if base is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (str, bool, dict) and isinstance(value, base):
            return value
    raise UserError(f"{source}: {key} has the wrong type ({type(value).__name__}: {value!r})")
