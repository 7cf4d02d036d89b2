"""fit(): the training loop, short enough to read on one screen."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from paratrain.config import TrainConfig
from paratrain.data.folder import DataSplit, ImageSamples, build_split
from paratrain.data.samplers import ShardedEvalSampler, train_sampler
from paratrain.data.transforms import eval_transform, train_transform
from paratrain.dist import comm
from paratrain.dist.runtime import Runtime, seed_everything, threads_per_process
from paratrain.engine import checkpoint
from paratrain.engine.evaluate import evaluate, logits_of
from paratrain.engine.schedule import build_scheduler, effective_lr
from paratrain.errors import UserError
from paratrain.models.registry import create_model, load_weights, read_state_dict
from paratrain.parallel import ModelParts, parallelize
from paratrain.report.log import get_logger
from paratrain.report.metrics import MetricsWriter, format_epoch


@dataclass
class EpochStats:
    loss: float
    acc: float
    images: int
    seconds: float


def default_workers(local_world_size: int) -> int:
    """Loader processes per rank: the cores left once every rank has one."""
    return max(0, min(8, threads_per_process(local_world_size) - 1))


def make_loaders(cfg: TrainConfig, split: DataSplit, rt: Runtime):
    workers = cfg.workers if cfg.workers is not None else default_workers(rt.env.local_world_size)
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=workers > 0,
    )
    train_set = ImageSamples(
        split.train, train_transform(cfg.image_size, cfg.crop_scale_min, cfg.hflip)
    )
    sampler = train_sampler(len(train_set), rt.rank, rt.world_size, cfg.seed)
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=False, **common)
    val_set = ImageSamples(split.val, eval_transform(cfg.image_size))
    val_sampler = ShardedEvalSampler(len(val_set), rt.rank, rt.world_size)
    return train_loader, DataLoader(val_set, sampler=val_sampler, **common), workers


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """Same seed on every rank, so every rank builds identical initial weights."""
    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model, num_classes, cfg.image_size)
    if cfg.weights:
        report = load_weights(model, read_state_dict(cfg.weights), cfg.weights_strict, cfg.weights)
        get_logger().info(report.summary(cfg.weights))
    return model


def build_optimizer(parts: ModelParts, cfg: TrainConfig, world_size: int) -> torch.optim.SGD:
    lr = effective_lr(cfg.lr, world_size, cfg.lr_scaling)
    return torch.optim.SGD(
        parts.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )


def train_one_epoch(
    parts: ModelParts, loader: DataLoader, optimizer, rt: Runtime, bar
) -> EpochStats:
    parts.train()
    start = time.perf_counter()
    totals = torch.zeros(3, dtype=torch.float64)  # loss*n, correct, n
    for images, labels in loader:
        images = images.to(rt.device, non_blocking=True)
        labels = labels.to(rt.device, non_blocking=True)
        logits = logits_of(parts(images))
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        n = labels.numel()
        totals += torch.tensor([loss.item() * n, (logits.argmax(1) == labels).sum().item(), n])
        if bar is not None:
            bar.update(n * rt.world_size)
            bar.set_postfix(loss=f"{totals[0] / totals[2]:.4f}")
    totals = comm.all_reduce_sum(totals)
    seconds = time.perf_counter() - start
    return EpochStats(
        loss=float(totals[0] / totals[2]),
        acc=float(totals[1] / totals[2]),
        images=int(totals[2]),
        seconds=seconds,
    )


def fit(cfg: TrainConfig, rt: Runtime) -> dict:
    log = get_logger()
    split = build_split(cfg.data, cfg.val_fraction, cfg.split_seed)
    run_dir, resume_from = comm.broadcast_object(_resolve_run(cfg) if rt.is_main else None)
    metrics = MetricsWriter(run_dir)

    parts = parallelize(build_model(cfg, len(split.classes)), cfg, rt)
    optimizer = build_optimizer(parts, cfg, rt.world_size)
    lr = optimizer.param_groups[0]["lr"]
    scheduler = build_scheduler(optimizer, cfg.epochs, cfg.lrf, cfg.warmup_epochs)
    start_epoch, best_top1 = 0, -1.0
    if resume_from is not None:
        state = checkpoint.load(resume_from)
        parts.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best_top1 = state["epoch"], state.get("best_top1", -1.0)
        log.info(f"resumed from {resume_from} at epoch {start_epoch + 1}")
    seed_everything(cfg.seed + 1000 * rt.rank + start_epoch)  # augmentation differs per rank
    train_loader, val_loader, workers = make_loaders(cfg, split, rt)

    if rt.is_main:
        _write_run_files(cfg, split, run_dir, rt)
        metrics.drop_after(start_epoch)
        log.info(
            f"run {run_dir}: {cfg.model} at {cfg.image_size}px, {len(split.classes)} classes, "
            f"{len(split.train)} train / {len(split.val)} val images, {rt.world_size} process(es) "
            f"on {rt.device.type} ({rt.backend or 'no process group'}), {workers} loader worker(s)"
        )
        log.info(
            f"global batch {cfg.batch_size * rt.world_size} ({cfg.batch_size} x {rt.world_size}), "
            f"lr {lr:g} (base {cfg.lr:g}, scaling {cfg.lr_scaling}), {cfg.epochs} epochs"
        )
    started = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on all ranks
        epoch_lr = optimizer.param_groups[0]["lr"]
        bar = _progress(rt, len(train_loader.sampler) * rt.world_size, epoch, cfg.epochs)
        stats = train_one_epoch(parts, train_loader, optimizer, rt, bar)
        result = evaluate(parts, val_loader, rt.device, len(split.classes))
        if bar is not None:
            bar.close()
        scheduler.step()
        row = {
            "epoch": epoch + 1,
            "lr": epoch_lr,
            "train_loss": stats.loss,
            "train_acc": stats.acc,
            "val_loss": result.loss,
            "val_top1": result.top1,
            "val_top5": result.top5,
            "val_count": result.count,
            "epoch_seconds": time.perf_counter() - epoch_start,
            "train_images_per_s": stats.images / stats.seconds,
        }
        if rt.is_main:
            metrics.write(row)
            log.info(format_epoch(row, cfg.epochs))
            is_best = result.top1 > best_top1
            best_top1 = max(best_top1, result.top1)
            state = {
                "model": parts.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch + 1,
                "best_top1": best_top1,
                "val_top1": result.top1,
                "classes": split.classes,
                "config": cfg.to_dict(),
                "world_size": rt.world_size,
            }
            checkpoint.save_atomic(state, run_dir / "checkpoints" / checkpoint.LAST)
            if is_best:
                checkpoint.save_atomic(state, run_dir / "checkpoints" / checkpoint.BEST)
    comm.barrier()
    return _summarise(cfg, run_dir, metrics, rt, time.perf_counter() - started)


def _resolve_run(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """Rank 0 decides the run directory and what to resume; every rank is told."""
    output = Path(cfg.output_dir)
    resume_from: Path | None = None
    if cfg.resume == "auto":
        resume_from = checkpoint.find_resumable(output, cfg.name)
    elif cfg.resume:
        resume_from = Path(cfg.resume)
        if not resume_from.is_file():
            raise UserError(f"--resume: checkpoint not found: {resume_from}")
    if cfg.name:
        name = cfg.name
    elif resume_from is not None and resume_from.parent.name == "checkpoints":
        name = resume_from.parent.parent.name
    else:
        name = time.strftime("%Y%m%d-%H%M%S")
    run_dir = output / name
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run_dir, resume_from


def _write_run_files(cfg: TrainConfig, split: DataSplit, run_dir: Path, rt: Runtime) -> None:
    resolved = TrainConfig(**{**cfg.to_dict(), "name": run_dir.name})
    resolved.save(run_dir / "config.yaml")
    (run_dir / "class_indices.json").write_text(json.dumps(split.class_index(), indent=2) + "\n")


def _progress(rt: Runtime, total: int, epoch: int, epochs: int):
    if not rt.is_main or not sys.stdout.isatty() or os.environ.get("PARATRAIN_NO_BAR"):
        return None
    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", unit="img", leave=False)


def _summarise(cfg, run_dir: Path, metrics: MetricsWriter, rt: Runtime, seconds: float) -> dict:
    rows = metrics.read() if rt.is_main else []
    summary = comm.broadcast_object(
        {
            "run_dir": str(run_dir),
            "model": cfg.model,
            "world_size": rt.world_size,
            "epochs": len(rows),
            "best_val_top1": max((r["val_top1"] for r in rows), default=None),
            "final": rows[-1] if rows else None,
            "seconds": seconds,
        }
        if rt.is_main
        else None
    )
    if rt.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        best = summary["best_val_top1"]
        get_logger().info(
            f"done in {seconds:.1f}s: best val top1 {best:.2%}, checkpoints in "
            f"{run_dir / 'checkpoints'}"
            if best is not None
            else f"done in {seconds:.1f}s (nothing left to train)"
        )
    return summary
