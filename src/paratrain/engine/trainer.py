"""fit(): the outline of a training run; train_epoch() and train_step(): the loop.

``setup`` builds a run's pieces once into a :class:`Run` (data, model and strategy,
optimizer, recipe, checkpoints, step control); the loop reads everything from it. One
optimizer step is ``train_step``: an explicit inner loop over its micro-batches, then
the agreement on the step, clipping and the optimizer. Nothing in a step reads a value
back from the device: losses and counts accumulate where the model computes.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import TrainConfig
from paratrain.data.device_batches import to_model
from paratrain.data.folder import DataSplit, build_split
from paratrain.data.loaders import Loaders, make_loaders, prepare_data
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime, seed_everything
from paratrain.engine import precision as precision_module
from paratrain.engine.checkpoint import (
    Checkpointer,
    last_of_run,
    resolve_run,
    resume,
    samples_per_step,
)
from paratrain.engine.control import StepControl
from paratrain.engine.evaluate import EvalResult, evaluate
from paratrain.engine.preempt import Interrupted, PreemptionGuard
from paratrain.engine.recipe import Recipe, build_optimizer, build_recipe
from paratrain.engine.schedule import Schedule, build_schedule, describe_schedule, peak_lr
from paratrain.engine.state import Progress
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.models.registry import build_model, check_model_input
from paratrain.parallel import ModelParts, parallelize
from paratrain.report.metrics import MetricsWriter, format_epoch
from paratrain.report.plots import plot_curves
from paratrain.report.run_files import (
    announce,
    nothing_left,
    progress_bar,
    summarise,
    write_run_files,
)
from paratrain.report.tensorboard import Board

__all__ = ["Run", "fit", "setup", "train_epoch", "train_step"]


@dataclass
class Run:
    """A run's pieces, built once by :func:`setup`; the loop reads them from here."""

    cfg: TrainConfig
    runtime: Runtime
    split: DataSplit
    run_dir: Path
    parts: ModelParts
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    recipe: Recipe
    loaders: Loaders
    progress: Progress
    saver: Checkpointer
    control: StepControl
    metrics: MetricsWriter
    board: Board


def fit(cfg: TrainConfig, runtime: Runtime) -> dict:
    """Train as configured, as this process's share of the job; returns rank 0's summary.

    The outline of every run, on every rank: set up (data, model, strategy, optimizer,
    recipe, the checkpoint to resume from), then per epoch train, evaluate, step the
    schedule, save and record; then summarise. Rank 0 alone writes files and speaks."""
    run = setup(cfg, runtime)
    if run.progress.epoch >= cfg.epochs:  # resumed from the end: nothing is rewritten
        return nothing_left(cfg, run.run_dir, runtime, run.progress.epoch)
    started = time.perf_counter()
    try:
        with run.control.guard, run.board:  # signals are acted on between steps
            for epoch in range(run.progress.epoch, cfg.epochs):
                epoch_start = time.perf_counter()
                train_seconds = train_epoch(run, epoch)
                result, averaged = validate(run)
                record_epoch(
                    run, epoch, time.perf_counter() - epoch_start, train_seconds, result, averaged
                )
    except KeyboardInterrupt:  # checkpoints are written whole or not at all: say which
        raise Interrupted(run.run_dir, last_of_run(run.run_dir)) from None
    comm.barrier()
    seconds = time.perf_counter() - started
    return summarise(cfg, run.run_dir, run.metrics, runtime, seconds, run.progress.skipped_steps)


def setup(cfg: TrainConfig, runtime: Runtime) -> Run:
    """Everything a run needs, in the order each piece depends on the one before."""
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    split = build_split(cfg.data, cfg.val_fraction, cfg.split_seed)
    try:  # before any file is written or image decoded; the same answer on every rank
        gpus = torch.cuda.device_count() if runtime.device.type == "cuda" else 0
        check_model_input(cfg, runtime.world_size, gpus)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    run_dir, resume_from = comm.agree(lambda: resolve_run(cfg))
    cache, split = prepare_data(cfg, split, runtime, run_dir)
    classes = len(split.classes)
    parts = parallelize(build_model(cfg, classes), cfg, runtime)
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    recipe = build_recipe(cfg, parts, classes, precision_module.build(cfg, runtime))
    recipe.precision.prepare(parts)  # after the EMA copy: it averages the model as built
    seed_everything(cfg.seed + 1000 * runtime.rank)  # model randomness (dropout) differs per rank
    progress = Progress()
    if resume_from is not None:
        try:  # the same checkpoint and settings on every rank: told once
            progress = resume(resume_from, cfg, runtime, parts, optimizer, recipe, split.classes)
        except UserError as exc:
            raise AgreedUserError(str(exc)) from None
    progress.totals = progress.totals.to(parts.output_device)  # summed where computed
    loaders = make_loaders(
        cfg, split, runtime, cache, parts.replica, parts.replicas, parts.fixed_batch
    )
    steps = -(-len(loaders.train) // cfg.grad_accum)
    schedule = build_schedule(cfg, parts.replicas, steps)
    saver = Checkpointer(cfg, run_dir, runtime, parts, optimizer, schedule, split.classes, recipe)
    control = StepControl(
        cfg,
        runtime,
        saver.save,
        PreemptionGuard(cfg.preempt_grace),
        sync_free=_sync_free(cfg, runtime, optimizer, recipe),
    )
    metrics = MetricsWriter(run_dir)
    if runtime.is_main and progress.epoch < cfg.epochs:
        write_run_files(cfg, split, run_dir)
        metrics.drop_after(progress.epoch)
        announce(
            cfg,
            split,
            run_dir,
            runtime,
            workers=loaders.workers,
            cached=loaders.cached,
            replicas=parts.replicas,
            global_batch=samples_per_step(cfg, parts.replicas),
            schedule=describe_schedule(peak_lr(cfg, parts.replicas), cfg),
            precision=recipe.precision.mode,
        )
    board = Board(run_dir, cfg.tensorboard and runtime.is_main, runtime.world_size)
    return Run(
        cfg,
        runtime,
        split,
        run_dir,
        parts,
        optimizer,
        schedule,
        recipe,
        loaders,
        progress,
        saver,
        control,
        metrics,
        board,
    )


def _sync_free(cfg: TrainConfig, runtime: Runtime, optimizer, recipe: Recipe) -> bool:
    """On CUDA, steps read nothing back (see engine/control.py), except where skipping a
    non-finite step needs the flag on the host: a GradScaler, EMA weights, or an
    optimizer that is not fused (FSDP's sharded parameters)."""
    if runtime.device.type != "cuda":
        return False
    if cfg.on_nonfinite == "abort":
        return True
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return fused and recipe.precision.scaler is None and recipe.ema is None


def train_epoch(run: Run, epoch: int) -> float:
    """One epoch of optimizer steps over this replica's shard; returns its seconds."""
    cfg, parts, progress = run.cfg, run.parts, run.progress
    loader = run.loaders.train
    run.loaders.sampler.set_epoch(epoch, progress.consumed)  # a new order every epoch
    bar = progress_bar(run.runtime, len(run.loaders.sampler) * parts.replicas, epoch, cfg.epochs)
    run.board.start_epoch()
    parts.train()
    run.optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    batches, remaining = iter(loader), len(loader)
    while remaining:
        count = min(cfg.grad_accum, remaining)  # the epoch's last step may have fewer
        remaining -= count
        run.schedule.apply(run.optimizer, epoch + progress.consumed / run.loaders.sampler.total)
        images = train_step(run, itertools.islice(batches, count), count)
        if bar is not None:
            bar.update(images * parts.replicas)
            if progress.global_step % run.control.check_every == 0:
                totals = progress.totals.tolist()
                bar.set_postfix(loss=f"{totals[0] / max(totals[2], 1):.4f}")
        run.control.after_step(progress)
    if bar is not None:
        bar.close()
    return time.perf_counter() - start


def train_step(run: Run, micro_batches: Iterator, count: int) -> int:
    """One optimizer step over ``count`` micro-batches: forward and backward of each,
    gradients kept local until the last (DDP's no_sync); then every rank agrees on the
    step, and the gradients are clipped and applied. Returns this process's images."""
    parts, recipe, optimizer, progress = run.parts, run.recipe, run.optimizer, run.progress
    run.control.begin_step(parts.buffers())
    step = torch.zeros(3, dtype=torch.float64, device=parts.output_device)  # loss x n, correct, n
    images_seen = 0
    for micro, (images, labels) in enumerate(micro_batches):
        images = to_model(images, parts.input_device, parts.memory_format)  # may augment there
        labels = labels.to(parts.output_device, non_blocking=True)
        targets = labels
        if recipe.mixer is not None:  # train accuracy is then against the unmixed labels
            images, targets = recipe.mixer(images, labels)
        local = micro < count - 1
        with parts.no_sync() if local else contextlib.nullcontext():
            loss, logits = parts.forward_backward(
                images, targets, recipe.criterion, recipe.precision, recipe.grad_accum
            )
        images_seen += labels.numel()
        if logits is not None:  # a pipeline's last stage alone has them
            n = labels.numel()  # on the device, with scalars from the host: nothing waits
            step[0] += loss.double() * n
            step[1] += (logits.argmax(1) == labels).sum()
            step[2] += n
    parts.after_backward()
    skipped = run.control.judge(step[0], progress)
    if skipped is not True:
        if recipe.clip_grad is not None:
            recipe.precision.unscale(optimizer)
            grads = [p for p in parts.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, recipe.clip_grad)
        flag = skipped if isinstance(skipped, torch.Tensor) else None
        recipe.precision.step(optimizer, found_inf=flag)
        if recipe.ema is not None:
            recipe.ema.update()
        counted = step if flag is None else torch.where(flag > 0, 0.0, step)
        progress.totals += counted
        if run.board.writer is not None:
            lr = optimizer.param_groups[0]["lr"]
            run.board.add(counted, progress.global_step + 1, lr, run.control.check_every)
    run.control.end_step(skipped)
    optimizer.zero_grad(set_to_none=True)
    progress.step_in_epoch += 1
    progress.global_step += 1
    progress.consumed += images_seen * parts.replicas
    return images_seen


def validate(run: Run) -> tuple[EvalResult, EvalResult | None]:
    """The model (and its EMA) on every validation image, each counted once."""
    run.control.check(run.progress)  # what the epoch's steps left unread, before anything uses it
    run.parts.agree_buffers()
    classes = len(run.split.classes)
    with run.recipe.precision.autocast():
        result = evaluate(run.parts, run.loaders.val, run.parts.input_device, classes)
        averaged = None
        if run.recipe.ema is not None:
            averaged = evaluate(run.recipe.ema.module, run.loaders.val, run.runtime.device, classes)
    return result, averaged


def record_epoch(
    run: Run,
    epoch: int,
    epoch_seconds: float,
    train_seconds: float,
    result: EvalResult,
    averaged: EvalResult | None,
) -> None:
    """Step the schedule, save, and write the epoch's metrics row, curves and line."""
    progress = run.progress
    epoch_lr = run.schedule.lr(epoch)
    totals = comm.all_reduce_sum(progress.totals).tolist()
    row = {
        "epoch": epoch + 1,
        "lr": epoch_lr,
        "train_loss": totals[0] / max(totals[2], 1),
        "train_acc": totals[1] / max(totals[2], 1),
        "val_loss": result.loss,
        "val_top1": result.top1,
        "val_top5": result.top5,
        "val_count": result.count,
        "skipped_steps": progress.skipped_steps,
        "epoch_seconds": epoch_seconds,
        "train_images_per_s": totals[2] / max(train_seconds, 1e-9),
        "world_size": run.runtime.world_size,
    }
    if averaged is not None:
        row.update(val_loss_ema=averaged.loss, val_top1_ema=averaged.top1)
    progress.best_top1 = max(progress.best_top1, result.top1)
    progress.start_epoch(epoch + 1)
    run.saver.save(progress, val_top1=result.top1)
    if run.runtime.is_main:
        run.metrics.write(row)
        plot_curves(run.metrics.read(), run.run_dir / "curves.png")
        run.board.epoch(row)
        get_logger().info(format_epoch(row, run.cfg.epochs))
