"""Learning-rate schedules, set every step: linear warm-up, then cosine, linear, step,
multistep or constant.

The rate is a function of how far training is, in epochs (a float: finished epochs plus
the share of this one's samples trained on), not of a step counter: a run resumed with
another batch size or world size (so another number of steps an epoch) continues the
same curve, and nothing about the schedule needs saving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paratrain.config import TrainConfig


def peak_lr(cfg: TrainConfig, replicas: int) -> float:
    """The rate the schedule peaks at: --lr as given, else --lr-base scaled linearly to
    the global batch (the linear scaling rule: N times the batch, N times the step)."""
    return cfg.rate(replicas)


def lr_rule(cfg: TrainConfig, replicas: int) -> str:
    """Which rule gave the peak rate, for the start line and --dry-run."""
    if cfg.lr is not None:
        return "--lr as given"
    return (
        f"--lr-base {cfg.lr_base:g} x global batch {cfg.global_batch(replicas)} / "
        f"{cfg.lr_base_size}"
    )


@dataclass(frozen=True)
class Schedule:
    peak: float
    epochs: float  # a fraction where --budget ends the run inside an epoch
    kind: str = "cosine"  # cosine, linear, step, multistep, constant
    lrf: float = 0.1  # cosine, linear: where it ends, as a fraction of the peak
    warmup: float = 0.0  # epochs
    warmup_start: float = 0.01  # the warm-up's first rate, as a fraction of the peak
    step_size: int = 30  # step: epochs between decays
    gamma: float = 0.1  # step, multistep: the factor of each decay
    milestones: tuple[int, ...] = ()  # multistep: epochs at which the rate decays

    def factor(self, t: float) -> float:
        """The multiplier of the peak rate ``t`` epochs into training."""
        if t < self.warmup:
            return self.warmup_start + (1 - self.warmup_start) * t / self.warmup
        after = t - self.warmup
        if self.kind in ("cosine", "linear"):
            span = max(self.epochs - self.warmup, 1e-9)
            x = min(max(after / span, 0.0), 1.0)
            left = (1 + math.cos(math.pi * x)) / 2 if self.kind == "cosine" else 1 - x
            return self.lrf + (1 - self.lrf) * left
        if self.kind == "step":
            return self.gamma ** math.floor(after / self.step_size + 1e-9)
        if self.kind == "multistep":
            return self.gamma ** sum(1 for m in self.milestones if t >= m - 1e-9)
        return 1.0

    def lr(self, t: float) -> float:
        """The learning rate ``t`` epochs into training."""
        return self.peak * self.factor(t)

    def apply(self, optimizer: torch.optim.Optimizer, t: float) -> float:
        """Set every group's rate for a step ``t`` epochs into training (times the
        group's ``lr_scale``: --head-lr-mult, --layer-decay); returns the base rate."""
        lr = self.lr(t)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr


RAMP = (0.5, 0.85)  # --progressive: the share of the run where the size starts and ends rising


def train_size_at(cfg: TrainConfig, epoch: int, epochs: float | None = None) -> int:
    """The training crop of ``epoch`` (0-based) of ``epochs``: --progressive's START for
    the first half of the run, rising linearly to END by 85% of it (FFCV's shape), in
    steps of 8 pixels; without it, the one training size."""
    if not cfg.progressive:
        return cfg.train_size
    start, end = cfg.progressive_sizes
    total = epochs if epochs is not None else cfg.epochs
    first, last = RAMP[0] * total, RAMP[1] * total
    if math.isinf(total):
        return start
    share = min(max((epoch - first) / max(last - first, 1e-9), 0.0), 1.0)
    size = int(math.ceil((start + (end - start) * share) / 8) * 8)
    return min(max(size, start), end)


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's rate now (a group's rate over its ``lr_scale``)."""
    group = optimizer.param_groups[0]
    return float(group["lr"]) / group.get("lr_scale", 1.0)


def build_schedule(cfg: TrainConfig, replicas: int, steps_per_epoch: int) -> Schedule:
    """The run's schedule: its peak for this global batch, warm-up in epochs (or in
    steps, converted with this run's steps an epoch)."""
    warmup = float(cfg.warmup_epochs)
    if cfg.warmup_steps:
        warmup = cfg.warmup_steps / max(steps_per_epoch, 1)
    return Schedule(
        peak=peak_lr(cfg, replicas),
        epochs=cfg.epochs,
        kind=cfg.sched,
        lrf=cfg.lrf,
        warmup=warmup,
        warmup_start=cfg.warmup_start,
        step_size=cfg.lr_step_size,
        gamma=cfg.lr_gamma,
        milestones=tuple(cfg.milestone_list()),
    )


def describe_schedule(cfg: TrainConfig, replicas: int) -> str:
    """The rates a run goes through, for the start line and --dry-run: the peak, the
    warm-up (which starts lower) and how the rate falls."""
    peak = peak_lr(cfg, replicas)
    warm = ""
    if cfg.warmup_epochs or cfg.warmup_steps:
        length = (
            f"{cfg.warmup_epochs} epoch(s)" if cfg.warmup_epochs else f"{cfg.warmup_steps} step(s)"
        )
        warm = f", warm-up {length} from {peak * cfg.warmup_start:g}"
    scaled = f" ({lr_rule(cfg, replicas)})"
    end = (
        f"by epoch {cfg.epochs}"
        if not cfg.budget
        else f"at the end of --budget {cfg.budget} (the epochs that fit, measured in the "
        "first steps)"
    )
    then = {
        "cosine": f"cosine to {peak * cfg.lrf:g} {end}",
        "linear": f"linearly to {peak * cfg.lrf:g} {end}",
        "step": f"x {cfg.lr_gamma:g} every {cfg.lr_step_size} epoch(s)",
        "multistep": f"x {cfg.lr_gamma:g} at epochs {cfg.lr_milestones}",
        "constant": "constant",
    }[cfg.sched]
    return f"peak lr {peak:g}{scaled}{warm}, {then}"
