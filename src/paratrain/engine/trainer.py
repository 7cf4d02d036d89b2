"""fit(): the outline of a training run; train_epoch() and train_step(): the loop.

``setup`` builds a run's pieces once into a :class:`Run` (data, model and strategy,
optimizer, recipe, checkpoints, step control); the loop reads everything from it. One
optimizer step is ``train_step``: an explicit inner loop over its micro-batches, then
the agreement on the step, clipping and the optimizer. Nothing in a step reads a value
back from the device: losses and counts accumulate where the model computes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config import TrainConfig
from paratrain.data.cache.verify import agree_intact
from paratrain.data.folder import DataSplit
from paratrain.data.loaders import (
    Loaders,
    keep_sides,
    make_loaders,
    prepare_data,
    read_split,
)
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime, seed_everything
from paratrain.engine.checkpointing.checkpoint import Checkpointer, resume
from paratrain.engine.checkpointing.run_dir import last_of_run, release_all, resolve_run
from paratrain.engine.inference.evaluate import EvalResult, evaluate
from paratrain.engine.prerun.budget import Budget, choose_recipe, concrete, duration, recipe_words
from paratrain.engine.prerun.describe import data_words, run_facts
from paratrain.engine.prerun.preflight import check_model_input
from paratrain.engine.run import precision as precision_module
from paratrain.engine.run.control import StepControl
from paratrain.engine.run.preempt import Interrupted, PreemptionGuard
from paratrain.engine.run.recipe import Recipe, build_optimizer, build_recipe
from paratrain.engine.run.schedule import Schedule, base_lr, build_schedule, train_size_at
from paratrain.engine.run.state import Progress
from paratrain.engine.run.step import Stepper
from paratrain.engine.run.step import train_step as one_step
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger, since_start
from paratrain.parallel.parallelize import build_parts
from paratrain.parallel.parts import ModelParts
from paratrain.report.loggers import Loggers
from paratrain.report.metrics import MetricsWriter, format_epoch
from paratrain.report.plots import plot_curves
from paratrain.report.run_files import (
    announce,
    nothing_left,
    progress_bar,
    summarise,
    write_run_files,
)

__all__ = ["Run", "fit", "setup", "train_epoch", "train_step", "train_worker"]


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
    loggers: Loggers
    stepper: Stepper
    first_step: float | None = None  # seconds from the command's start to its first step
    budget: Budget | None = None  # --budget: the plan that sizes the schedule
    # the epoch just trained stopped before its end (--max-steps, --budget): its
    # checkpoint is a mid-epoch one, so a resumed run trains the rest of it
    cut_short: bool = False
    told_frozen: bool = False  # said that --budget's plan ends before --freeze-epochs


def train_worker(cfg: TrainConfig, env: DistEnv) -> dict:
    """One process of a training job: its logger, its process group, fit()."""
    from paratrain.distributed.runtime import distributed
    from paratrain.log import setup_logging

    setup_logging(env.rank, env.world_size)
    with distributed(env, cfg.device, cfg.backend, cfg.timeout) as runtime:
        return fit(cfg, runtime)


def fit(cfg: TrainConfig, runtime: Runtime) -> dict:
    """Train as configured (:func:`_train`); the run folder is let go of at the end,
    however it ends, and removed if nothing was trained in it."""
    try:
        return _train(cfg, runtime)
    finally:
        release_all()


def _train(cfg: TrainConfig, runtime: Runtime) -> dict:
    """Train as configured, as this process's share of the job; returns rank 0's summary.

    The outline of every run, on every rank: set up (data, model, strategy, optimizer,
    recipe, the checkpoint to resume from), then per epoch train, evaluate, step the
    schedule, save and record; then summarise. Rank 0 alone writes files and speaks."""
    run = setup(cfg, runtime)
    cfg = run.cfg  # with --budget-recipe low-res, its sizes
    if run.budget is not None:  # resumed with its budget spent, or planned on from here
        if run.budget.left() <= 0:
            return budget_spent(run)
        plan(run, max(run.schedule.epochs, run.progress.epoch + 1.0))
    elif run.progress.epoch >= cfg.epochs:  # resumed from the end: nothing is rewritten
        return nothing_left(cfg, run.run_dir, runtime, run.progress.epoch)
    started = time.perf_counter()
    try:
        with run.control.guard, run.loggers:  # signals are acted on between steps
            epoch = run.progress.epoch
            while epoch < run.cfg.epochs:  # --budget may move the end
                epoch_start = time.perf_counter()
                train_seconds = train_epoch(run, epoch)
                result, averaged = validate(run)
                record_epoch(
                    run, epoch, time.perf_counter() - epoch_start, train_seconds, result, averaged
                )
                if run.budget is not None:
                    cost = time.perf_counter() - epoch_start
                    plan(run, run.budget.after_epoch(float(epoch + 1), cost))
                if cfg.max_steps and run.progress.global_step >= cfg.max_steps:
                    break  # --max-steps: evaluated and saved above
                epoch += 1
            if run.loggers.active:
                run.loggers.finish(run.run_dir / "curves.png", last_of_run(run.run_dir))
    except KeyboardInterrupt:  # checkpoints are written whole or not at all: say which
        raise Interrupted(run.run_dir, last_of_run(run.run_dir)) from None
    comm.barrier()
    seconds = time.perf_counter() - started
    skipped = run.progress.skipped_steps
    return summarise(cfg, run.run_dir, run.metrics, runtime, seconds, skipped, run.first_step)


def budget_spent(run: Run) -> dict:
    """--budget with nothing left of it: a run that had not trained a step is refused
    (the start-up took the budget); a resumed one is told how to extend it."""
    budget, cfg = run.budget, run.cfg
    assert budget is not None
    spent = duration(budget.elapsed())
    if run.progress.global_step == 0:
        raise AgreedUserError(
            f"--budget {cfg.budget} was used up before the first step (start-up: {spent}): "
            "give a budget longer than the start-up"
        )
    told = (
        f"{run.run_dir}: --budget {cfg.budget} is spent ({spent} trained, the rest kept for "
        f"saving and ending); a longer --budget trains on"
    )
    return nothing_left(cfg, run.run_dir, run.runtime, run.progress.epoch, told)


def setup(cfg: TrainConfig, runtime: Runtime) -> Run:
    """Everything a run needs, in the order each piece depends on the one before."""
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    split = read_split(cfg, runtime)
    try:  # before any file is written or image decoded; the same answer on every rank
        check_model_input(cfg, runtime.world_size)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    run_dir, resume_from = comm.agree(lambda: resolve_run(cfg))
    split = keep_sides(split, run_dir, resume_from is not None, runtime)
    intent, cfg = _budget_recipe(cfg, runtime, split, run_dir if resume_from else None)
    cache, split = prepare_data(cfg, split, runtime, run_dir)
    classes = len(split.classes)
    parts = build_parts(cfg, classes, runtime)
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
    saver.spent_before = progress.seconds
    budget = None
    if cfg.budget_seconds is not None:
        budget = Budget(cfg.budget_seconds, progress.seconds, steps, len(loaders.val))
    control = StepControl(
        cfg,
        runtime,
        saver.save,
        PreemptionGuard(cfg.preempt_grace),
        sync_free=_sync_free(cfg, runtime, optimizer, recipe),
    )
    metrics = MetricsWriter(run_dir)
    if runtime.is_main and progress.epoch < cfg.epochs:
        write_run_files(intent, split, run_dir)  # the recipe by name: --config keeps it
        metrics.drop_after(progress.epoch)
        _announce(cfg, runtime, split, loaders, recipe, run_dir, resume_from)
    tracked = cfg.loggers if runtime.is_main else ()  # rank 0 alone reports
    loggers = Loggers(
        run_dir,
        tracked,
        cfg.to_dict(),
        runtime.world_size,
        cfg.tracker_timeout,
        cfg.on_tracker_error,
    )
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
        loggers,
        Stepper(parts, optimizer, recipe, control),
        budget=budget,
    )


def _budget_recipe(
    cfg: TrainConfig, runtime: Runtime, split: DataSplit, resumed: Path | None
) -> tuple[TrainConfig, TrainConfig]:
    """(the recipe by name, as config.yaml records it; the settings it trains with):
    --budget-recipe auto decided (engine/prerun/budget.py), low-res made sizes and said."""
    intent = choose_recipe(cfg, runtime, len(split.train), len(split.val), resumed)
    cfg = concrete(intent)
    if cfg is not intent:
        try:
            check_model_input(cfg, runtime.world_size)
        except UserError as exc:
            raise AgreedUserError(f"--budget-recipe low-res: {exc}") from None
        get_logger().info(
            f"--budget-recipe low-res: {recipe_words(intent)} (--budget-recipe fixed keeps "
            "the sizes as given)"
        )
    return intent, cfg


def _announce(cfg, runtime, split, loaders, recipe, run_dir, resume_from) -> None:
    """The start lines (rank 0): how the run is laid out, what it reads, how it steps."""
    facts = run_facts(
        cfg,
        processes=f"{runtime.world_size} process(es) ({runtime.env.source})",
        world=runtime.world_size,
        cuda=runtime.device.type == "cuda",
        backend=runtime.backend,
        data=data_words(cfg, split) + f", {loaders.workers} loader worker(s)",
        precision=recipe.precision.mode,
        cache=f"{loaders.cache.kind} ({loaders.cache.directory})"
        if loaders.cache is not None
        else "off (decoding every epoch)",
        resume=f"from {resume_from}" if resume_from is not None else "",
    )
    announce(run_dir, facts)


def _sync_free(cfg: TrainConfig, runtime: Runtime, optimizer, recipe: Recipe) -> bool:
    """On CUDA, steps read nothing back (see engine/run/control.py), except where skipping a
    non-finite step needs the flag on the host: a GradScaler, EMA weights, or an
    optimizer that is not fused (the model's parts say where fused kernels cannot run)."""
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
    run.loggers.start_epoch()
    freezing = run.recipe.freezing
    if freezing is not None and freezing.set_epoch(epoch):
        get_logger().info(f"epoch {epoch + 1}: the backbone thaws; every layer trains")
    if cfg.progressive:  # --progressive: this epoch's size, over the planned length
        length = run.schedule.epochs
        if run.budget is not None and run.budget.planned is None:
            length = math.inf  # not planned yet (the first steps time it): the start size
        size = train_size_at(cfg, epoch, length)
        if run.budget is not None:  # a moving end never takes the size back down
            size = run.budget.largest = max(size, run.budget.largest)
        if size != run.loaders.train_size:
            run.loaders.train_at(size)
            get_logger().info(f"epoch {epoch + 1}: training at {size}px")
        loader = run.loaders.train
    parts.train()
    run.optimizer.zero_grad(set_to_none=True)
    start, first = time.perf_counter(), progress.global_step
    batches, remaining = iter(loader), len(loader)
    while remaining:
        count = min(cfg.grad_accum, remaining)  # the epoch's last step may have fewer
        remaining -= count
        run.schedule.apply(run.optimizer, epoch + progress.consumed / run.loaders.sampler.total)
        images = train_step(run, itertools.islice(batches, count), count)
        if run.first_step is None:  # what a user waits for: from the command to training
            run.first_step = since_start()
            get_logger().info(f"first step {run.first_step:.1f} s after the command started")
        if bar is not None:
            bar.update(images * parts.replicas)
            if progress.global_step % run.control.check_every == 0:
                totals = progress.totals.tolist()
                bar.set_postfix(loss=f"{totals[0] / max(totals[2], 1):.4f}")
        run.control.after_step(progress)
        if run.budget is not None:  # --budget: plan after the first steps, end on time
            trained = epoch + progress.consumed / run.loaders.sampler.total
            if (planned := run.budget.after_step(trained)) is not None:
                plan(run, planned, bar, epoch)
            if run.budget.done(trained):
                break
        if cfg.max_steps and progress.global_step >= cfg.max_steps:
            break
    run.cut_short = remaining > 0
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    if run.budget is not None:  # an epoch too short to time: planned before its line
        trained = epoch + progress.consumed / run.loaders.sampler.total
        steps = progress.global_step - first
        if (planned := run.budget.first_plan(trained, seconds, steps)) is not None:
            plan(run, planned)
    return seconds


def plan(run: Run, epochs: float, bar=None, epoch: int = 0) -> None:
    """The schedule ends at ``epochs`` (a fraction allowed): --budget's plan. A plan
    that ends before --freeze-epochs thaws the backbone says so, once; the epoch's
    progress bar, if any, counts to the new end."""
    freezing = run.cfg.freeze_epochs
    if freezing and epochs <= freezing and run.budget is not None and run.budget.planned:
        if not run.told_frozen:
            get_logger().info(
                f"--budget fits {epochs:.1f} epoch(s), not more than --freeze-epochs "
                f"{freezing}: the backbone stays frozen for the whole run"
            )
        run.told_frozen = True
    run.schedule = dataclasses.replace(run.schedule, epochs=epochs)
    run.saver.schedule = run.schedule
    whole = max(math.ceil(epochs - 1e-9), 1)
    run.cfg = run.saver.cfg = dataclasses.replace(run.cfg, epochs=whole)
    if bar is not None:
        bar.set_description(f"epoch {epoch + 1}/{whole}")


def train_step(run: Run, micro_batches: Iterator, count: int) -> int:
    """One optimizer step of the run (engine/run/step.py), then what the run keeps of it:
    the epoch's sums, the step counters, the trackers' scalars. Returns this process's
    images."""
    progress = run.progress
    result = one_step(run.stepper, micro_batches, count, progress)
    if result.skipped is not True:
        progress.totals += result.sums
        if run.loggers.active:
            lr = base_lr(run.optimizer)
            run.loggers.add(result.sums, progress.global_step + 1, lr, run.control.check_every)
    progress.step_in_epoch += 1
    progress.global_step += 1
    progress.consumed += result.images * run.parts.replicas
    return result.images


def validate(run: Run) -> tuple[EvalResult, EvalResult | None]:
    """The model (and its EMA) on every validation image, each counted once."""
    run.control.check(run.progress)  # what the epoch's steps left unread, before anything uses it
    last = run.progress.epoch + 1 >= run.cfg.epochs
    agree_intact(run.loaders.cache, wait=last)  # the cache's background check: damage stops
    run.parts.agree_buffers()
    classes = len(run.split.classes)
    with run.recipe.precision.autocast():
        tta, limit = run.cfg.tta == "flip", run.cfg.limit_val_batches
        val, device = run.loaders.val, run.runtime.device
        result = evaluate(run.parts, val, run.parts.input_device, classes, tta=tta, limit=limit)
        averaged = None
        if run.recipe.ema is not None:
            averaged = evaluate(run.recipe.ema.module, val, device, classes, tta=tta, limit=limit)
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
        **{f"val_{name}": value for name, value in result.scores().items()},
        "val_count": result.count,
        "skipped_steps": progress.skipped_steps,
        "epoch_seconds": epoch_seconds,
        "train_images_per_s": totals[2] / max(train_seconds, 1e-9),
        "world_size": run.runtime.world_size,
        "first_step_s": run.first_step,
        "since_start_s": since_start(),  # when the epoch's evaluation ended, from the command
    }
    if averaged is not None:
        row.update(val_loss_ema=averaged.loss, val_top1_ema=averaged.top1)
    score = result.score(run.cfg.monitor)  # what picks best.pt (--monitor)
    progress.best_top1 = max(progress.best_top1, score)
    if not run.cut_short:  # else saved mid-epoch: a resumed run trains the rest of it
        progress.start_epoch(epoch + 1)
    run.saver.save(progress, val_top1=score)
    if run.runtime.is_main:
        run.metrics.write(row)
        plot_curves(run.metrics.read(), run.run_dir / "curves.png")
        run.loggers.epoch(row, progress.global_step)
        get_logger().info(format_epoch(row, run.cfg.epochs))
