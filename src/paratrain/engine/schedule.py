"""Learning-rate schedule: linear warm-up, then per-epoch cosine from lr down to lr*lrf."""

from __future__ import annotations

import math

import torch

from paratrain.config import TrainConfig


def cosine_factor(epoch: int, epochs: int, lrf: float) -> float:
    """lf(x) = ((1 + cos(pi*x/epochs)) / 2) * (1 - lrf) + lrf."""
    return ((1 + math.cos(math.pi * epoch / epochs)) / 2) * (1 - lrf) + lrf


def lr_factor(epoch: int, epochs: int, lrf: float, warmup_epochs: int = 0) -> float:
    """Multiplier of the base lr during ``epoch`` (0-based).

    Warm-up epochs ramp linearly, 1/(W+1), 2/(W+1), ..., up to the cosine value; the
    cosine runs over the epochs after warm-up.
    """
    if epoch < warmup_epochs:
        return (epoch + 1) / (warmup_epochs + 1) * cosine_factor(0, epochs, lrf)
    span = max(epochs - warmup_epochs, 1)
    return cosine_factor(epoch - warmup_epochs, span, lrf)


def effective_lr(lr: float, world_size: int, scaling: str) -> float:
    """The linear scaling rule: N times the global batch, N times the step size."""
    return lr * world_size if scaling == "linear" else lr


def peak_lr(cfg: TrainConfig, replicas: int) -> float:
    """The rate the schedule peaks at: --lr scaled for the global batch."""
    return effective_lr(cfg.lr, replicas * cfg.grad_accum, cfg.lr_scaling)


def describe_schedule(peak: float, cfg: TrainConfig) -> str:
    """The rates a run goes through, for the start line and --dry-run: the peak, the
    warm-up (which starts lower) and where the cosine ends."""
    warm = ""
    if cfg.warmup_epochs:
        first = lr_factor(0, cfg.epochs, cfg.lrf, cfg.warmup_epochs) * peak
        warm = f", warm-up {cfg.warmup_epochs} epoch(s) from {first:g}"
    scaled = (
        f" ({cfg.lr:g} x {peak / cfg.lr:g}, {cfg.lr_scaling} scaling)" if peak != cfg.lr else ""
    )
    return f"peak lr {peak:g}{scaled}{warm}, cosine to {peak * cfg.lrf:g} by epoch {cfg.epochs}"


def build_scheduler(
    optimizer: torch.optim.Optimizer, epochs: int, lrf: float, warmup_epochs: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-epoch schedule: warm-up, then cosine from the peak to peak x lrf."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda e: lr_factor(e, epochs, lrf, warmup_epochs)
    )
