"""Checkpoints: whole and atomic on disk, written by the Checkpointer, read back by
resume().

A checkpoint holds the unwrapped model, EMA weights, optimizer (in the single-device
layout every strategy shares), LR scheduler, grad scaler, where training stands, every
rank's RNG states, the classes and the resolved config. It is written to a temporary
file, flushed, fsynced and renamed, so a reader sees the old file or the new one.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.engine.recipe import Recipe
from paratrain.engine.schedule import effective_lr, lr_factor, peak_lr
from paratrain.engine.state import Progress, gathered_rng_states, restore_rng
from paratrain.errors import UserError
from paratrain.log import get_logger
from paratrain.parallel import ModelParts

LAST = "last.pt"
BEST = "best.pt"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def copy_atomic(state: dict[str, Any], written: Path, path: Path) -> None:
    """``path`` gets the checkpoint just written to ``written`` (the same ``state``): a hard
    link, renamed into place, instead of a second 90 MB write; a write where the file
    system has no hard links. A later replacement of ``written`` leaves ``path`` alone."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    try:
        tmp.unlink(missing_ok=True)
        os.link(written, tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        save_atomic(state, path)
        return
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint file as a dict; anything else is one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise UserError(f"checkpoint {path} could not be read: {exc}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a paratrain checkpoint (no 'model' entry)")
    return state


def run_dir_of(path: str | Path) -> Path | None:
    """The run directory of a checkpoint saved by training (<run>/checkpoints/x.pt)."""
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else None


def find_resumable(output_dir: Path, name: str | None) -> Path | None:
    """``--resume auto``: last.pt of the named run, else of the newest run that has one."""
    if name:
        candidate = output_dir / name / "checkpoints" / LAST
        return candidate if candidate.is_file() else None
    found = sorted(
        output_dir.glob(f"*/checkpoints/{LAST}"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    return found[0] if found else None


def prune_epochs(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` epoch-NNNN.pt files (last.pt and best.pt are separate)."""
    epochs = sorted(directory.glob("epoch-*.pt"))
    for old in epochs[: max(0, len(epochs) - keep)]:
        old.unlink(missing_ok=True)


def samples_per_step(cfg: TrainConfig, replicas: int) -> int:
    """The global batch: per-process batch x model replicas x accumulated micro-batches."""
    return cfg.batch_size * replicas * cfg.grad_accum


def resolve_run(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume from (None: a fresh start). Rank 0
    decides; every rank is told."""
    output = Path(cfg.output_dir)
    resume = cfg.resume
    if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"  # a restarted worker continues from the last checkpoint
    resume_from: Path | None = None
    if resume == "auto":
        resume_from = find_resumable(output, cfg.name)
    elif resume:
        resume_from = Path(resume)
        if not resume_from.is_file():
            raise UserError(f"--resume: checkpoint not found: {resume_from}")
    if cfg.name:
        name = cfg.name
    elif resume_from is not None and run_dir_of(resume_from) is not None:
        name = run_dir_of(resume_from).name
    else:
        name = time.strftime("%Y%m%d-%H%M%S")
    run_dir = output / name
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run_dir, resume_from


class Checkpointer:
    """Whole-state checkpoints: last.pt (every save), best.pt, the newest --keep epochs."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        runtime: Runtime,
        parts: ModelParts,
        optimizer: torch.optim.Optimizer,
        scheduler,
        classes: list[str],
        recipe: Recipe,
    ):
        self.cfg, self.dir, self.runtime = cfg, run_dir / "checkpoints", runtime
        self.parts, self.optimizer, self.scheduler = parts, optimizer, scheduler
        self.classes, self.recipe = classes, recipe

    def save(self, progress: Progress, val_top1: float | None = None) -> None:
        """A collective: every rank calls it; rank 0 writes."""
        rng = gathered_rng_states()
        if self.runtime.is_main or self.parts.collective_state:  # staged or sharded: all give
            model = self.parts.state_dict()
            optimizer = self.parts.optimizer_state_dict(self.optimizer)
        if not self.runtime.is_main:
            return
        ema, scaler = self.recipe.ema, self.recipe.precision.scaler
        state = {
            "model": model,
            "ema": ema.state_dict() if ema is not None else None,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": progress.epoch,
            "step_in_epoch": progress.step_in_epoch,
            "consumed": progress.consumed,
            "global_step": progress.global_step,
            "skipped_steps": progress.skipped_steps,
            "partial_totals": progress.totals.detach().cpu().clone(),
            "best_top1": progress.best_top1,
            "val_top1": val_top1,
            "rng": rng,
            "classes": self.classes,
            "config": self.cfg.to_dict(),
            "world_size": self.parts.replicas,  # data-parallel copies: what the batch scales by
            "processes": self.runtime.world_size,
            "strategy": self.cfg.strategy,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        last = self.dir / LAST
        save_atomic(state, last)
        if val_top1 is None:
            return
        if val_top1 >= progress.best_top1:
            copy_atomic(state, last, self.dir / BEST)
        if self.cfg.keep:
            copy_atomic(state, last, self.dir / f"epoch-{progress.epoch:04d}.pt")
            prune_epochs(self.dir, self.cfg.keep)


def resume(
    path: Path,
    cfg: TrainConfig,
    runtime: Runtime,
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    recipe: Recipe,
) -> Progress:
    """Put the run back where the checkpoint left it; returns where training stands."""
    log = get_logger()
    state = load(path)
    parts.load_state_dict(state["model"])
    ema, scaler = recipe.ema, recipe.precision.scaler
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if ema is not None:
        if state.get("ema"):
            ema.load_state_dict(state["ema"])
        else:
            log.warning(f"{path} holds no EMA weights: the average starts from the resumed ones")
    parts.load_optimizer_state_dict(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(state.get("rng"), runtime.rank)
    progress = Progress(
        epoch=state["epoch"],
        step_in_epoch=state.get("step_in_epoch", 0),
        consumed=state.get("consumed", 0),
        global_step=state.get("global_step", 0),
        skipped_steps=state.get("skipped_steps", 0),
        best_top1=state.get("best_top1", -1.0),
    )
    old_world = state.get("world_size", parts.replicas)
    if old_world != parts.replicas:
        _rescale(state, cfg, parts.replicas, optimizer, scheduler, progress)
    elif state.get("partial_totals") is not None and runtime.is_main:
        progress.totals = state["partial_totals"]  # rank 0 carries the epoch's sums so far
    where = f"epoch {progress.epoch + 1}" + (
        f", step {progress.step_in_epoch}" if progress.step_in_epoch else ""
    )
    log.info(f"resumed from {path} at {where}")
    return progress


def _rescale(
    state: dict, cfg: TrainConfig, replicas: int, optimizer, scheduler, progress: Progress
) -> None:
    """Another number of model replicas (data-parallel world size): the global batch
    changes, and with it the scaled lr."""
    old_world, old_batch = state["world_size"], state["config"]["batch_size"]
    old_accum = state["config"].get("grad_accum", 1)
    new_lr = peak_lr(cfg, replicas)
    old_lr = effective_lr(
        state["config"]["lr"], old_world * old_accum, state["config"]["lr_scaling"]
    )
    scheduler.base_lrs = [new_lr for _ in scheduler.base_lrs]
    factor = lr_factor(scheduler.last_epoch, cfg.epochs, cfg.lrf, cfg.warmup_epochs)
    for group in optimizer.param_groups:
        group["lr"] = new_lr * factor
        group["initial_lr"] = new_lr
    per_step = samples_per_step(cfg, replicas)
    if progress.step_in_epoch and (progress.consumed % per_step):
        get_logger().warning(
            "the interrupted epoch resumes at a sample offset that does not "
            "divide by the new global batch; the step count is rounded down"
        )
    progress.step_in_epoch = progress.consumed // per_step
    progress.consumed = progress.step_in_epoch * per_step
    get_logger().info(
        f"world size {old_world} -> {replicas}: global batch "
        f"{old_batch * old_world * old_accum} -> {per_step}, lr {old_lr:g} -> {new_lr:g}"
    )
