"""fit(): the training loop, short enough to read on one screen.

Checkpointing, preemption, non-finite losses and progress live in small helpers the loop
calls (StepControl, Checkpointer), not in the loop itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from paratrain.config import TrainConfig
from paratrain.data.cache import (
    CachedImages,
    DecodedCache,
    batched,
    cached_eval_transform,
    cached_train_transform,
    prepare,
)
from paratrain.data.folder import DataSplit, ImageSamples, build_split
from paratrain.data.samplers import ShardedEvalSampler, train_sampler
from paratrain.data.scan import AgreedUserError, screen
from paratrain.data.transforms import eval_samples, train_transform
from paratrain.dist import comm
from paratrain.dist.runtime import Runtime, seed_everything, threads_per_process
from paratrain.engine import checkpoint, faults
from paratrain.engine.evaluate import evaluate
from paratrain.engine.precision import Precision
from paratrain.engine.precision import resolve as resolve_precision
from paratrain.engine.preempt import Preempted, PreemptionGuard, requeue
from paratrain.engine.recipe import EMA, build_criterion, build_mixer, build_optimizer
from paratrain.engine.schedule import build_scheduler, effective_lr, lr_factor
from paratrain.engine.state import gathered_rng_states, restore_rng
from paratrain.errors import UserError
from paratrain.models.registry import (
    create_model,
    freeze_backbone,
    load_weights,
    read_state_dict,
)
from paratrain.parallel import parallelize
from paratrain.report.log import get_logger
from paratrain.report.metrics import MetricsWriter, format_epoch
from paratrain.report.plots import plot_curves
from paratrain.report.tensorboard import Board

__all__ = ["build_model", "build_optimizer", "fit"]


class NonFiniteLoss(UserError):
    exit_code = 3
    agreed = True  # every rank raises it on the same step; rank 0 tells it


@dataclass
class Progress:
    """Where training stands: enough to resume in the middle of an epoch."""

    epoch: int = 0  # the epoch being trained (0-based)
    step_in_epoch: int = 0  # optimizer steps done in it
    global_step: int = 0
    skipped_steps: int = 0
    best_top1: float = -1.0
    totals: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))


def samples_per_step(cfg: TrainConfig, world_size: int) -> int:
    """The global batch: per-process batch x processes x accumulated micro-batches."""
    return cfg.batch_size * world_size * cfg.grad_accum


def default_workers(local_world_size: int) -> int:
    """Loader processes per rank: the cores left once every rank has one."""
    return max(0, min(8, threads_per_process(local_world_size) - 1))


def loader_workers(cfg: TrainConfig, rt: Runtime, cached: bool = False) -> int:
    """``--workers``, else the cores left over; none when a CPU trains from the cache:
    its augmentation (0.06 ms an image at 64 px) costs less in the training process
    than a worker that takes turns with the compute threads on their cores — measured,
    ResNet-18 at 64 px on 2 cores: 315-338 images/s without a worker, 295-304 with one."""
    if cfg.workers is not None:
        return cfg.workers
    if cached and rt.device.type == "cpu":
        return 0
    return default_workers(rt.env.local_world_size)


def decode_workers(cfg: TrainConfig, rt: Runtime) -> int:
    """Processes per rank that decode every image once (cache build, screen): nothing
    else runs meanwhile, so all of the rank's cores (at least ``--workers``); one core
    decodes in the rank itself. ``--workers 0`` keeps all of it in the rank's process."""
    if cfg.workers == 0:
        return 0
    cores = min(8, threads_per_process(rt.env.local_world_size))
    return max(cfg.workers or 0, cores if cores > 1 else 0)


def prepare_data(cfg: TrainConfig, split: DataSplit, rt: Runtime, run_dir: Path | None):
    """The decoded-image cache (built by all ranks, or None) and the split screened for
    unreadable images. Building the cache decodes every image, so it is the screen too;
    without a cache every image is decoded once just to check it."""
    workers = decode_workers(cfg, rt)
    cache = prepare(
        split.train + split.val, cfg.image_size, cfg.cache, cfg.cache_max_gb, cfg.cache_dir, workers
    )
    found = cache.bad if cache is not None else None
    return cache, screen(split, cfg.bad_images, rt.rank, rt.world_size, workers, run_dir, found)


def make_loaders(
    cfg: TrainConfig, split: DataSplit, rt: Runtime, cache: DecodedCache | None, parts=None
):
    """Sharded over the model's replicas (every process, except that a pipeline's
    stages read the same batches)."""
    workers = loader_workers(cfg, rt, cached=cache is not None)
    replica, replicas = (
        (parts.replica, parts.replicas) if parts is not None else (rt.rank, rt.world_size)
    )
    common = dict(
        batch_size=cfg.batch_size,
        num_workers=workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=workers > 0,
    )
    if cache is not None:
        train_set = CachedImages(
            split.train,
            cache,
            cached_train_transform(cfg.image_size, cfg.crop_scale_min, cfg.hflip),
        )
        val_set = CachedImages(split.val, cache, cached_eval_transform(cfg.image_size))
    else:
        train_set = ImageSamples(
            split.train, train_transform(cfg.image_size, cfg.crop_scale_min, cfg.hflip)
        )
        val_set = eval_samples(split.val, cfg.image_size)
    if cache is not None:
        common["collate_fn"] = batched
    sampler = train_sampler(len(train_set), replica, replicas, cfg.seed)
    fixed = parts is not None and parts.fixed_batch
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=fixed, **common)
    val_sampler = ShardedEvalSampler(len(val_set), replica, replicas)
    loaders = train_loader, DataLoader(val_set, sampler=val_sampler, **common)
    return (*loaders, workers, cache is not None)


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """Same seed on every rank, so every rank builds identical initial weights. A bad name
    or weights file fails on every rank alike; rank 0 alone reports it."""
    torch.manual_seed(cfg.seed)
    try:
        model = create_model(cfg.model, num_classes, cfg.image_size)
        if cfg.weights:
            weights = read_state_dict(cfg.weights)
            report = load_weights(model, weights, cfg.weights_strict, cfg.weights)
            get_logger().info(report.summary(cfg.weights))
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    if cfg.freeze_backbone:
        head, trained, total = freeze_backbone(model, cfg.model)
        get_logger().info(
            f"--freeze-backbone: training only `{head}`, {trained:,} of {total:,} parameters"
            + ("" if cfg.weights else " (no --weights: the frozen backbone stays random)")
        )
    return model


@dataclass
class Recipe:
    """What the loop applies around each step; built once from the config."""

    criterion: nn.Module
    mixer: object | None = None  # (images, labels) -> (mixed images, soft targets)
    ema: EMA | None = None
    board: Board | None = None
    precision: Precision | None = None
    grad_accum: int = 1
    clip_grad: float | None = None


class Checkpointer:
    """Whole-state checkpoints: last.pt (every save), best.pt, the newest --keep epochs."""

    def __init__(
        self, cfg, run_dir: Path, rt: Runtime, parts, optimizer, scheduler, classes, recipe
    ):
        self.cfg, self.dir, self.rt = cfg, run_dir / "checkpoints", rt
        self.ema, self.scaler = recipe.ema, recipe.precision.scaler
        self.parts, self.optimizer, self.scheduler, self.classes = (
            parts,
            optimizer,
            scheduler,
            classes,
        )

    def save(self, progress: Progress, val_top1: float | None = None) -> None:
        rng = gathered_rng_states()  # a collective: every rank takes part
        if self.rt.is_main or self.parts.collective_state:  # staged or sharded: all give
            model = self.parts.state_dict()
            optimizer = self.parts.optimizer_state_dict(self.optimizer)
        if not self.rt.is_main:
            return
        state = {
            "model": model,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": progress.epoch,
            "step_in_epoch": progress.step_in_epoch,
            "consumed": progress.step_in_epoch * samples_per_step(self.cfg, self.parts.replicas),
            "global_step": progress.global_step,
            "skipped_steps": progress.skipped_steps,
            "partial_totals": progress.totals.clone(),
            "best_top1": progress.best_top1,
            "val_top1": val_top1,
            "rng": rng,
            "classes": self.classes,
            "config": self.cfg.to_dict(),
            "world_size": self.parts.replicas,  # data-parallel copies: what the batch scales by
            "processes": self.rt.world_size,
            "strategy": self.cfg.strategy,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        checkpoint.save_atomic(state, self.dir / checkpoint.LAST)
        if val_top1 is None:
            return
        last = self.dir / checkpoint.LAST
        if val_top1 >= progress.best_top1:
            checkpoint.copy_atomic(state, last, self.dir / checkpoint.BEST)
        if self.cfg.keep:
            checkpoint.copy_atomic(state, last, self.dir / f"epoch-{progress.epoch:04d}.pt")
            checkpoint.prune_epochs(self.dir, self.cfg.keep)


class StepControl:
    """Per-step decisions every rank must agree on: non-finite loss, preemption, saves."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, saver: Checkpointer, guard: PreemptionGuard):
        self.cfg, self.rt, self.saver, self.guard = cfg, rt, saver, guard
        self.fault = faults.planned(rt.rank)
        self.stop_requested = False

    def loss_is_bad(self, loss: torch.Tensor, progress: Progress) -> bool:
        """All-reduce (non-finite, stop) so that every rank acts alike on this step."""
        poisoned = faults.fire(self.fault, progress.global_step + 1)
        bad = poisoned or not bool(torch.isfinite(loss.detach()).all())
        stop = int(self.guard.signum > 0)
        flags = comm.all_reduce_sum(torch.tensor([int(bad), stop], dtype=torch.int64))
        self.stop_requested = bool(flags[1])
        if flags[0] and self.cfg.on_nonfinite == "abort":
            raise NonFiniteLoss(
                f"non-finite loss at step {progress.global_step + 1} (epoch {progress.epoch + 1}) "
                f"on {int(flags[0])} rank(s); --on-nonfinite skip would skip such steps"
            )
        return bool(flags[0])

    def after_step(self, progress: Progress) -> None:
        every = self.cfg.save_every_steps
        if self.stop_requested:
            self.guard.reached_boundary()
            self.saver.save(progress)
            signum = self.guard.signum or signal.SIGTERM  # a rank that saw none follows the others
            if self.cfg.requeue and self.rt.is_main:
                requeue(os.environ)
            raise Preempted(signum)
        if every and progress.global_step % every == 0:
            self.saver.save(progress)


def train_one_epoch(
    parts,
    loader,
    optimizer,
    rt: Runtime,
    control: StepControl,
    progress: Progress,
    bar,
    recipe: Recipe,
) -> float:
    """One epoch; an optimizer step every ``accum`` micro-batches (and after the last)."""
    parts.train()
    start = time.perf_counter()
    accum, last = recipe.grad_accum, len(loader) - 1
    optimizer.zero_grad(set_to_none=True)
    micro, step_loss, step_correct, step_n, step_images = 0, 0.0, 0, 0, 0
    for index, (images, labels) in enumerate(loader):
        images = images.to(parts.input_device, non_blocking=True, memory_format=parts.memory_format)
        labels = labels.to(parts.output_device, non_blocking=True)
        targets = labels
        if recipe.mixer is not None:  # train accuracy is then against the unmixed labels
            images, targets = recipe.mixer(images, labels)
        micro += 1
        stepping = micro == accum or index == last
        # the first accum-1 micro-batches keep their gradients local (DDP's no_sync)
        with contextlib.nullcontext() if stepping else parts.no_sync():
            loss, logits = parts.forward_backward(
                images, targets, recipe.criterion, recipe.precision, accum
            )
        step_images += labels.numel()
        if logits is not None:  # a pipeline's last stage alone has them
            step_loss += loss.item() * labels.numel()
            step_correct += (logits.argmax(1) == labels).sum().item()
            step_n += labels.numel()
        if not stepping:
            continue
        parts.after_backward()
        if control.loss_is_bad(torch.tensor(step_loss), progress):
            progress.skipped_steps += 1
        else:
            if recipe.clip_grad is not None:
                recipe.precision.unscale(optimizer)
                torch.nn.utils.clip_grad_norm_(
                    [p for p in parts.parameters() if p.grad is not None], recipe.clip_grad
                )
            recipe.precision.step(optimizer)
            if recipe.ema is not None:
                recipe.ema.update()
            progress.totals += torch.tensor([step_loss, step_correct, step_n], dtype=torch.float64)
            if recipe.board is not None and step_n:
                recipe.board.step(
                    progress.global_step + 1,
                    step_loss / step_n,
                    step_correct / step_n,
                    optimizer.param_groups[0]["lr"],
                    step_n,
                )
        optimizer.zero_grad(set_to_none=True)
        progress.step_in_epoch += 1
        progress.global_step += 1
        if bar is not None:
            bar.update(step_images * parts.replicas)
            bar.set_postfix(loss=f"{progress.totals[0] / max(progress.totals[2], 1):.4f}")
        micro, step_loss, step_correct, step_n, step_images = 0, 0.0, 0, 0, 0
        control.after_step(progress)
    return time.perf_counter() - start


def fit(cfg: TrainConfig, rt: Runtime) -> dict:
    log = get_logger()
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    split = build_split(cfg.data, cfg.val_fraction, cfg.split_seed)
    run_dir, resume_from = comm.broadcast_object(_resolve_run(cfg) if rt.is_main else None)
    cache, split = prepare_data(cfg, split, rt, run_dir)
    metrics = MetricsWriter(run_dir)

    parts = parallelize(build_model(cfg, len(split.classes)), cfg, rt)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    recipe = Recipe(
        criterion=build_criterion(cfg),
        mixer=build_mixer(cfg, len(split.classes)),
        ema=EMA(parts, cfg.ema_decay) if cfg.ema_decay else None,
        precision=build_precision(cfg, rt),
        grad_accum=cfg.grad_accum,
        clip_grad=cfg.clip_grad,
    )
    recipe.precision.prepare(parts)
    scheduler = build_scheduler(optimizer, cfg.epochs, cfg.lrf, cfg.warmup_epochs)
    seed_everything(cfg.seed + 1000 * rt.rank)  # model randomness (dropout) differs per rank
    progress = Progress()
    if resume_from is not None:
        progress = _resume(resume_from, cfg, rt, parts, optimizer, scheduler, recipe)
    train_loader, val_loader, workers, cached = make_loaders(cfg, split, rt, cache, parts)
    saver = Checkpointer(cfg, run_dir, rt, parts, optimizer, scheduler, split.classes, recipe)
    guard = PreemptionGuard(cfg.preempt_grace).install()
    control = StepControl(cfg, rt, saver, guard)
    if rt.is_main:
        _write_run_files(cfg, split, run_dir)
        metrics.drop_after(progress.epoch)
        _announce(
            cfg,
            split,
            run_dir,
            rt,
            workers,
            optimizer.param_groups[0]["lr"],
            cached,
            parts.replicas,
        )
        log.info(
            f"precision {recipe.precision.mode}"
            + (" (auto)" if cfg.precision == "auto" else "")
            + (", torch.compile (the first steps compile)" if cfg.compile else "")
        )
    recipe.board = Board(run_dir, cfg.tensorboard and rt.is_main, rt.world_size)
    started = time.perf_counter()
    try:
        for epoch in range(progress.epoch, cfg.epochs):
            epoch_start = time.perf_counter()
            consumed = progress.step_in_epoch * samples_per_step(cfg, parts.replicas)
            train_loader.sampler.set_epoch(epoch, consumed)  # a new order every epoch
            epoch_lr = optimizer.param_groups[0]["lr"]
            bar = _progress_bar(rt, len(train_loader.sampler) * parts.replicas, epoch, cfg.epochs)
            recipe.board.start_epoch()
            train_seconds = train_one_epoch(
                parts, train_loader, optimizer, rt, control, progress, bar, recipe
            )
            parts.agree_buffers()
            with recipe.precision.autocast():
                result = evaluate(parts, val_loader, parts.input_device, len(split.classes))
                if recipe.ema is not None:
                    averaged = evaluate(
                        recipe.ema.module, val_loader, rt.device, len(split.classes)
                    )
            if bar is not None:
                bar.close()
            scheduler.step()
            totals = comm.all_reduce_sum(progress.totals)
            row = {
                "epoch": epoch + 1,
                "lr": epoch_lr,
                "train_loss": float(totals[0] / max(totals[2], 1)),
                "train_acc": float(totals[1] / max(totals[2], 1)),
                "val_loss": result.loss,
                "val_top1": result.top1,
                "val_top5": result.top5,
                "val_count": result.count,
                "skipped_steps": progress.skipped_steps,
                "epoch_seconds": time.perf_counter() - epoch_start,
                "train_images_per_s": float(totals[2]) / max(train_seconds, 1e-9),
                "world_size": rt.world_size,
            }
            if recipe.ema is not None:
                row.update(val_loss_ema=averaged.loss, val_top1_ema=averaged.top1)
            progress.best_top1 = max(progress.best_top1, result.top1)
            progress.epoch, progress.step_in_epoch, progress.totals = (
                epoch + 1,
                0,
                torch.zeros(3, dtype=torch.float64),
            )
            saver.save(progress, val_top1=result.top1)
            if rt.is_main:
                metrics.write(row)
                plot_curves(metrics.read(), run_dir / "curves.png")
                recipe.board.epoch(row)
                log.info(format_epoch(row, cfg.epochs))
    finally:
        guard.uninstall()
        recipe.board.close()
    comm.barrier()
    return _summarise(cfg, run_dir, metrics, rt, time.perf_counter() - started, progress)


def build_precision(cfg: TrainConfig, rt: Runtime) -> Precision:
    try:
        return Precision(resolve_precision(cfg.precision, rt.device), rt.device)
    except UserError as exc:  # the same device type on every rank: the same answer
        raise AgreedUserError(str(exc)) from None


def _resume(
    path: Path, cfg: TrainConfig, rt: Runtime, parts, optimizer, scheduler, recipe: Recipe
) -> Progress:
    log = get_logger()
    state = checkpoint.load(path)
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
    restore_rng(state.get("rng"), rt.rank)
    progress = Progress(
        epoch=state["epoch"],
        step_in_epoch=state.get("step_in_epoch", 0),
        global_step=state.get("global_step", 0),
        skipped_steps=state.get("skipped_steps", 0),
        best_top1=state.get("best_top1", -1.0),
    )
    old_world = state.get("world_size", parts.replicas)
    if old_world != parts.replicas:
        _rescale(state, cfg, parts.replicas, optimizer, scheduler, progress)
    elif state.get("partial_totals") is not None and rt.is_main:
        progress.totals = state["partial_totals"]  # rank 0 carries the epoch's sums so far
    where = f"epoch {progress.epoch + 1}" + (
        f", step {progress.step_in_epoch}" if progress.step_in_epoch else ""
    )
    log.info(f"resumed from {path} at {where}")
    return progress


def _rescale(
    state, cfg: TrainConfig, replicas: int, optimizer, scheduler, progress: Progress
) -> None:
    """Another number of model replicas (data-parallel world size): the global batch
    changes, and with it the scaled lr."""
    old_world, old_batch = state["world_size"], state["config"]["batch_size"]
    old_accum = state["config"].get("grad_accum", 1)
    new_lr = effective_lr(cfg.lr, replicas * cfg.grad_accum, cfg.lr_scaling)
    old_lr = effective_lr(
        state["config"]["lr"], old_world * old_accum, state["config"]["lr_scaling"]
    )
    scheduler.base_lrs = [new_lr for _ in scheduler.base_lrs]
    factor = lr_factor(scheduler.last_epoch, cfg.epochs, cfg.lrf, cfg.warmup_epochs)
    for group in optimizer.param_groups:
        group["lr"] = new_lr * factor
        group["initial_lr"] = new_lr
    per_step = samples_per_step(cfg, replicas)
    if progress.step_in_epoch and (state.get("consumed", 0) % per_step):
        get_logger().warning(
            "the interrupted epoch resumes at a sample offset that does not "
            "divide by the new global batch; the step count is rounded down"
        )
    progress.step_in_epoch = state.get("consumed", 0) // per_step
    get_logger().info(
        f"world size {old_world} -> {replicas}: global batch "
        f"{old_batch * old_world * old_accum} -> {per_step}, lr {old_lr:g} -> {new_lr:g}"
    )


def _resolve_run(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """Rank 0 decides the run directory and what to resume; every rank is told."""
    output = Path(cfg.output_dir)
    resume = cfg.resume
    if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"  # a restarted worker continues from the last checkpoint
    resume_from: Path | None = None
    if resume == "auto":
        resume_from = checkpoint.find_resumable(output, cfg.name)
    elif resume:
        resume_from = Path(resume)
        if not resume_from.is_file():
            raise UserError(f"--resume: checkpoint not found: {resume_from}")
    if cfg.name:
        name = cfg.name
    elif resume_from is not None and checkpoint.run_dir_of(resume_from) is not None:
        name = checkpoint.run_dir_of(resume_from).name
    else:
        name = time.strftime("%Y%m%d-%H%M%S")
    run_dir = output / name
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run_dir, resume_from


def _write_run_files(cfg: TrainConfig, split: DataSplit, run_dir: Path) -> None:
    resolved = TrainConfig(**{**cfg.to_dict(), "name": run_dir.name})
    resolved.save(run_dir / "config.yaml")
    (run_dir / "class_indices.json").write_text(json.dumps(split.class_index(), indent=2) + "\n")


def _announce(
    cfg,
    split: DataSplit,
    run_dir: Path,
    rt: Runtime,
    workers: int,
    lr: float,
    cached: bool,
    replicas: int,
) -> None:
    log = get_logger()
    log.info(
        f"run {run_dir}: {cfg.model} at {cfg.image_size}px, {len(split.classes)} classes, "
        f"{len(split.train)} train / {len(split.val)} val images, {rt.world_size} process(es) "
        f"on {rt.device.type} ({rt.backend or 'no process group'}), {workers} loader worker(s), "
        f"{'decoded-image cache' if cached else 'decoding every epoch'}"
    )
    log.info(
        f"global batch {samples_per_step(cfg, replicas)} ({cfg.batch_size} x "
        f"{replicas}{f' x {cfg.grad_accum} micro-batches' if cfg.grad_accum > 1 else ''}), "
        f"{cfg.opt} lr {lr:g} (base {cfg.lr:g}, scaling {cfg.lr_scaling}), {cfg.epochs} epochs"
        + _recipe_words(cfg)
    )


def _recipe_words(cfg: TrainConfig) -> str:
    words = [
        f"label smoothing {cfg.label_smoothing:g}" if cfg.label_smoothing else "",
        f"mixup {cfg.mixup:g}" if cfg.mixup else "",
        f"cutmix {cfg.cutmix:g}" if cfg.cutmix else "",
        f"EMA decay {cfg.ema_decay:g}" if cfg.ema_decay else "",
    ]
    words = [w for w in words if w]
    return ", " + ", ".join(words) if words else ""


def _progress_bar(rt: Runtime, total: int, epoch: int, epochs: int):
    if not rt.is_main or not sys.stdout.isatty() or os.environ.get("PARATRAIN_NO_BAR"):
        return None
    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", unit="img", leave=False)


def _summarise(
    cfg, run_dir: Path, metrics: MetricsWriter, rt: Runtime, seconds: float, progress: Progress
) -> dict:
    rows = metrics.read() if rt.is_main else []
    summary = comm.broadcast_object(
        {
            "run_dir": str(run_dir),
            "model": cfg.model,
            "world_size": rt.world_size,
            "epochs": len(rows),
            "best_val_top1": max((r["val_top1"] for r in rows), default=None),
            "final": rows[-1] if rows else None,
            "skipped_steps": progress.skipped_steps,
            "seconds": seconds,
        }
        if rt.is_main
        else None
    )
    if rt.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        best = summary["best_val_top1"]
        skipped = (
            f", {progress.skipped_steps} non-finite step(s) skipped"
            if progress.skipped_steps
            else ""
        )
        get_logger().info(
            f"done in {seconds:.1f}s: best val top1 {best:.2%}{skipped}, checkpoints in "
            f"{run_dir / 'checkpoints'}"
            if best is not None
            else f"done in {seconds:.1f}s (nothing left to train)"
        )
    return summary
